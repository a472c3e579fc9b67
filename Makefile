# One entry point for people and CI. Every target installs what it needs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch. On this kind of machine pip finds it on disk; elsewhere add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu so pip does not fetch a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: install ci test test-pure stress demo lint bench clean native-asan fuzz native-pythons lmdb-versions

$(STAMP): pyproject.toml setup.py lmdbcache/_native/_core.c lmdbcache/_native/_augment.c Makefile
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
# pure-Python path, then the engine tests on the oldest and newest py-lmdb the package admits.
ci: lint test test-pure lmdb-versions

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
# libstdc++ too: with only the ASan runtime preloaded, a C++ exception thrown inside torch aborts (CHECK failed:
# real___cxa_throw), which would look like a crash of ours.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libstdc++.so.6)
SANITIZE = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
native-asan: install
	LMDBCACHE_CFLAGS="$(SANITIZE) -O1 -g" LMDBCACHE_LDFLAGS="$(SANITIZE)" \
		$(PY) setup.py -q build_ext --inplace --force --build-temp build/asan
	LD_PRELOAD="$(ASAN_LIB)" ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_native_core.py tests/test_native_encode.py tests/test_table.py tests/stress/test_fuzz_file.py tests/test_augment.py tests/test_compact.py; \
		status=$$?; $(PY) setup.py -q build_ext --inplace --force; exit $$status

fuzz: native-asan

# The compiled core on every CPython the package declares (requires-python >= 3.10), not only the venv's: for
# each pyenv interpreter found (a missing one is skipped with a message), a venv in build/pythons/<version> without
# torch, the package installed into it (the extension compiled afresh by that interpreter; its output in build.log
# there), then, run from outside the checkout against that copy, the core's byte-level tests
# (tests/test_native_core.py: XXH3 against xxhash, the snapshot reader against py-lmdb) and the packaging tests
# (tests/test_packaging.py: the sdist has _core.c, a wheel built from it is a platform wheel for that version).
# Fails on a compiler warning or error in _core.c, a core that is not built or that imports torch, or a failed test.
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHONS ?= 3.10.13 3.11.7 3.12.1 3.13.0
NATIVE_TEST_DEPS = setuptools wheel numpy lmdb xxhash pytest pytest-timeout hypothesis msgpack msgpack-numpy filelock \
	tqdm
native-pythons:
	@failed=""; ran=""; \
	for v in $(PYTHONS); do \
		py="$(PYENV_ROOT)/versions/$$v/bin/python3"; dir="$(CURDIR)/build/pythons/$$v"; \
		if [ ! -x "$$py" ]; then echo "== $$v: skipped ($$py not found)"; continue; fi; \
		echo "== $$v: venv and dependencies in build/pythons/$$v"; ran="$$ran $$v"; \
		{ [ -x "$$dir/bin/python" ] || "$$py" -m venv "$$dir"; } && \
		"$$dir/bin/python" -m pip install --quiet --disable-pip-version-check $(NATIVE_TEST_DEPS) || \
			{ failed="$$failed $$v(deps)"; continue; }; \
		echo "== $$v: building the extension (log: build/pythons/$$v/build.log)"; \
		tag=$$("$$dir/bin/python" -c "import sys; print(sys.implementation.cache_tag)"); \
		rm -rf build/lib.*-$$tag build/temp.*-$$tag; \
		"$$dir/bin/python" -m pip install -v --disable-pip-version-check --no-deps --no-build-isolation \
			--force-reinstall . >"$$dir/build.log" 2>&1 || \
			{ tail -20 "$$dir/build.log"; failed="$$failed $$v(install)"; continue; }; \
		if grep -E "_core\.c:[0-9]+(:[0-9]+)?: (fatal )?(warning|error)" "$$dir/build.log"; then \
			failed="$$failed $$v(compiler)"; continue; fi; \
		(cd "$$dir" && bin/python -c "import sys, lmdbcache._native as n; import lmdbcache._native._core; \
			assert 'torch' not in sys.modules, 'the core imported torch'; \
			assert n.NATIVE, 'the compiled core was not built or not imported'; \
			assert n.core.__file__.startswith(sys.prefix), n.core.__file__; print('   core:', n.core.__file__)") || \
			{ failed="$$failed $$v(import)"; continue; }; \
		(cd "$$dir" && bin/python -m pytest -q -p no:cacheprovider -W error \
			"$(CURDIR)/tests/test_native_core.py" "$(CURDIR)/tests/test_packaging.py") || \
			failed="$$failed $$v(tests)"; \
	done; \
	echo "== native-pythons: ran:$${ran:- none}; failed:$${failed:- none}"; [ -z "$$failed" ]

# py-lmdb across what pyproject admits (lmdb>=1.4, but not 2.2.0-2.2.1: they invalidate the named-database handles
# that a map growth keeps, fixed in 2.3.0) and both engines of 3.x (LMDB 0.9 and 1.0: two page layouts). For the
# oldest (LMDB_OLDEST: built from its sdist where no wheel fits this Python, ~20 s) and the newest on the index
# (LMDB_NEWEST, empty: pip's newest, looked up again at every run), a venv in build/lmdb/<version> holding only
# that py-lmdb, everything else taken from .venv (a .pth placed after the venv's own packages: torch is not installed
# twice), then the tests whose outcome depends on the engine: tests/test_engines.py (fill with map growth, reopen,
# info, verify, batches, both read paths, the LMDB 1.0 golden cache, or under a py-lmdb without 1.0 the clear error
# it gives) and tests/test_native_core.py (the core's snapshot reader against py-lmdb on each engine it has). The
# newest runs test_engines.py again with LMDB_DEFAULT_LIB_VERSION=1: this process's own new caches are LMDB 1.0's.
LMDB_OLDEST ?= 1.4.0
LMDB_NEWEST ?=
LMDB_TESTS = tests/test_engines.py tests/test_native_core.py
lmdb-versions: install
	@site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); failed=""; \
	for spec in "oldest lmdb==$(LMDB_OLDEST)" "newest lmdb$(if $(LMDB_NEWEST),==$(LMDB_NEWEST))"; do \
		set -- $$spec; dir="$(CURDIR)/build/lmdb/$$1"; \
		{ [ -x "$$dir/bin/python" ] || $(PY) -m venv --system-site-packages "$$dir"; } && \
		"$$dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$$2" && \
		own=$$("$$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		printf 'import site; site.addsitedir("%s")\n' "$$site" >"$$own/zz_lmdbcache_base.pth" || \
			{ failed="$$failed $$1(install)"; continue; }; \
		version=$$("$$dir/bin/python" -c "import lmdb; print(lmdb.__version__, lmdb.version())"); \
		echo "== $$1: py-lmdb $$version (build/lmdb/$$1)"; \
		"$$dir/bin/python" -m pytest -q -p no:cacheprovider $(LMDB_TESTS) || failed="$$failed $$1"; \
		if [ "$$1" = newest ]; then \
			echo "== newest, LMDB_DEFAULT_LIB_VERSION=1"; \
			LMDB_DEFAULT_LIB_VERSION=1 "$$dir/bin/python" -m pytest -q -p no:cacheprovider tests/test_engines.py || \
				failed="$$failed newest(LMDB_DEFAULT_LIB_VERSION=1)"; \
		fi; \
	done; \
	echo "== lmdb-versions: failed:$${failed:- none}"; [ -z "$$failed" ]

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
	$(PY) bench/compact.py --reps 3
	$(PY) -m bench.native --reps 5
	$(PY) -m bench.single --reps 3
	$(PY) -m bench.scale --reps 3
	$(PY) -m bench.augment --reps 3

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
