# One entry point for people and CI. Every target installs what it needs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch. On this kind of machine pip finds it on disk; elsewhere add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu so pip does not fetch a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: install ci test test-pure stress demo lint bench clean native-asan fuzz

$(STAMP): pyproject.toml setup.py lmdbcache/_native/_core.c Makefile
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "Using the torch that $(PYTHON) already imports."; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	@$(PY) -c "import torch" >/dev/null 2>&1 || { \
		echo "Installing torch (CPU build: $(TORCH_SPEC)); this can take a minute."; \
		$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); }
	$(PY) -m pip install --quiet -e ".[test,dev,pillow]"
	@touch $(STAMP)

install: $(STAMP)

# Every check, as CI runs it (.ci/run): lint, types, then the tests on the compiled core and again on the
# pure-Python path.
ci: lint test test-pure

# tests/stress runs here in its short form; `make stress` runs it long (minutes).
test: install
	@$(PY) -c "import lmdbcache._native as n, sys; sys.exit(0 if n.NATIVE else 'the compiled core was not built (see the pip install output)')"
	$(PY) -m pytest -q

# The same tests on the pure-Python path (the compiled core switched off, as when it cannot be built).
test-pure: install
	LMDBCACHE_PURE_PYTHON=1 $(PY) -m pytest -q

stress: install
	LMDBCACHE_STRESS=1 $(PY) -m pytest tests/stress -q -s

# The compiled core (lmdbcache/_native/_core.c) built with AddressSanitizer and UndefinedBehaviorSanitizer, then its
# own tests and the damaged-file fuzz run against it: any report fails the run (halt_on_error). The ASan runtime is
# preloaded because the interpreter itself is not built with it. The plain module is rebuilt afterwards.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
SANITIZE = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
native-asan: install
	LMDBCACHE_CFLAGS="$(SANITIZE) -O1 -g" LMDBCACHE_LDFLAGS="$(SANITIZE)" \
		$(PY) setup.py -q build_ext --inplace --force --build-temp build/asan
	LD_PRELOAD="$(ASAN_LIB)" ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_native.py tests/stress/test_fuzz_file.py; \
		status=$$?; $(PY) setup.py -q build_ext --inplace --force; exit $$status

fuzz: native-asan

demo: install
	$(PY) scripts/demo.py

lint: install
	$(PY) -m ruff check lmdbcache tests scripts bench
	$(PY) -m ruff format --check lmdbcache tests scripts bench
	$(PY) -m mypy lmdbcache

# Peers are installed so they cannot replace the CPU torch (none of them requires torch but
# torchdata, whose `torch>=2` the installed CPU torch satisfies: `pip install --dry-run` keeps it;
# kappadata's dependencies would pull torchvision, timm and a CUDA torch, hence --no-deps).
# A peer that cannot be installed is skipped, with a note in the results.
bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	-$(PY) -m pip install --quiet diskcache datasets
	-$(PY) -m pip install --quiet --no-deps kappadata
	-$(PY) -m pip install --quiet torchdata==0.11.0 spdl==0.8.0
	$(PY) -m bench.run
	$(PY) -m bench.loader --reps 3
	$(PY) -m bench.cold --reps 3
	$(PY) -m bench.compress --reps 3
	$(PY) -m bench.pack --reps 3

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
