"""The ``lmdbcache`` command, run as real subprocesses on real caches."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
from helpers import Synthetic
from test_processes import check_cache, wait_for_count

from lmdbcache import FORMAT_VERSION, CachedDataset, precompute, tools
from lmdbcache.store import _registry
from lmdbcache.tools._spec import load_spec, parse_args_kv

TESTS = Path(__file__).parent
ROOT = TESTS.parent
SPEC = "helpers:Synthetic"


def cli(*args: str, check: int | None = 0, wait: bool = True, env: dict | None = None, **kwargs):
    """Run ``python -m lmdbcache ARGS`` with tests/ importable; return the CompletedProcess (or Popen)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), **(env or {})}
    argv = [sys.executable, "-m", "lmdbcache", *args]
    if not wait:
        return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    result = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=180, **kwargs)
    if check is not None:
        assert result.returncode == check, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``lmdbcache ARGS`` in this process (no interpreter start-up): for help and user-error paths."""
    from lmdbcache.tools.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse: --help, bad arguments
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def one_line_error(result) -> str:
    """A user error: non-zero exit, one line on stderr, no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_precompute_builds_the_whole_cache(cache_dir):
    """precompute with 2 workers caches every index, equal to the source; info reports it."""
    result = cli("precompute", SPEC, str(cache_dir), "--arg", "n=300", "--workers", "2", "--quiet")
    assert "Wrote 300 samples, skipped 0" in result.stdout and "300/300" in result.stdout
    check_cache(cache_dir, 300)
    data = json.loads(cli("info", str(cache_dir), "--json").stdout)
    assert {"length", "cached", "fingerprint", "format_version", "size_bytes", "map_size", "created"} <= set(data)
    assert (data["length"], data["cached"], data["format_version"]) == (300, 300, FORMAT_VERSION)
    assert data["fingerprint"] == "Synthetic:300" and data["size_bytes"] > 300 * 192
    text = cli("info", str(cache_dir)).stdout
    assert "300 (100.0%, complete)" in text and "Synthetic:300" in text
    again = cli("precompute", SPEC, str(cache_dir), "--arg", "n=300", "--quiet")
    assert "Wrote 0 samples, skipped 300" in again.stdout


def test_spec_from_a_file_and_the_scripts_wrapper(cache_dir):
    """A SPEC may be path/to/file.py:callable; scripts/precompute.py runs the same command."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "scripts" / "precompute.py")
    wrapper = [sys.executable, script, f"{TESTS / 'helpers.py'}:Synthetic", str(cache_dir), "--arg", "n=40"]
    result = subprocess.run(
        [*wrapper, "--arg", 'count_dir="/nonexistent"', "--workers", "0", "--check-determinism", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr  # count_dir does not exist: index 0 fails
    assert "index 0" in result.stderr and "FileNotFoundError" in result.stderr
    result = subprocess.run(
        [*wrapper, "--workers", "1", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    check_cache(cache_dir, 40)


@pytest.mark.parametrize("command", ["precompute", "info", "verify", "warm", "copy", "merge"])
def test_every_subcommand_has_help_with_an_example(command, capsys):
    """`lmdbcache CMD --help` exits 0 and shows an example."""
    result = run_main(capsys, command, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and f"lmdbcache {command}" in result.stdout


def test_help_points_at_pages_that_hold_what_it_names(capsys):
    """Where `--help` sends the reader (precompute --pack: the Packs section) exists: a docs page with that heading."""
    text = " ".join(run_main(capsys, "precompute", "--help").stdout.split())
    assert "see docs/usage.md, Packs)" in text and "README" not in text
    assert "**Packs (`pack=K`" in (Path(__file__).parent.parent / "docs" / "usage.md").read_text()


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("no_colon_here", [], "must be package.module:callable"),
        ("no_such_module_xyz:make", [], "Cannot import 'no_such_module_xyz'"),
        ("helpers:NoSuchThing", [], "has no attribute 'NoSuchThing'"),
        ("helpers:TESTS_CONSTANT", [], "not a callable"),
        ("helpers:not_a_dataset", [], "not a map-style dataset"),
        ("helpers:Synthetic", ["--arg", "bogus=1"], "unexpected keyword argument 'bogus'"),
        ("helpers:Synthetic", ["--arg", "novalue"], "key=value"),
        ("/nonexistent/file.py:make", [], "does not exist"),
    ],
)
def test_bad_specs_are_one_line_errors(cache_dir, spec, args, message, capsys):
    """A SPEC that does not import, is not callable or returns no dataset exits 1 with one line, no traceback."""
    result = run_main(capsys, "precompute", spec, str(cache_dir), *args)
    assert result.returncode == 1
    assert message in one_line_error(result)
    assert not (cache_dir / "data.mdb").exists()


def test_a_bad_spec_from_the_real_command(cache_dir):
    """The installed command (a fresh interpreter) reports a bad SPEC the same way: one line, exit 1."""
    assert "Cannot import 'no_such_module_xyz'" in one_line_error(
        cli("precompute", "no_such_module_xyz:make", str(cache_dir), check=1)
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["precompute", SPEC, "PATH", "--shard", "3/3"], "precompute: error: argument --shard: '3/3' is not I/N"),
        (["precompute", SPEC, "PATH", "--shard", "1-3"], "precompute: error: argument --shard: '1-3' is not I/N"),
        (["precompute", SPEC], "precompute: error: the following arguments are required: PATH"),
        (["info", "PATH", "extra"], "info: error: unrecognized arguments: extra"),
        (["merge", "OUT", "S1", "--frobnicate"], "merge: error: unrecognized arguments: --frobnicate"),
        (["frobnicate"], "lmdbcache: error: argument COMMAND: invalid choice: 'frobnicate'"),
        ([], "lmdbcache: error: the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(cache_dir, capsys, args, expected):
    """A malformed command line exits 2 with one line: what is wrong, and the --help to read (as the README says)."""
    args = [str(cache_dir) if a == "PATH" else a for a in args]
    line = one_line_error(run_main(capsys, *args))
    assert run_main(capsys, *args).returncode == 2
    assert expected in line and "usage:" not in line, line
    command = args[0] if args and args[0] in ("precompute", "info", "merge") else None
    assert line.endswith(f"(see `lmdbcache {command} --help`)" if command else "(see `lmdbcache --help`)"), line
    assert not cache_dir.exists()


def test_user_errors_on_caches_are_one_line(tmp_path, capsys):
    """info/verify/warm/copy on a path that holds no cache exit 1 with one line, creating nothing."""
    missing = tmp_path / "missing"
    for args in (
        ["info", str(missing)],
        ["verify", str(missing)],
        ["warm", str(missing)],
        ["copy", str(missing), str(tmp_path / "x")],
    ):
        result = run_main(capsys, *args)
        assert result.returncode == 1 and "no cache" in one_line_error(result)
    assert not missing.exists() and not (tmp_path / "x").exists()


def test_sharded_build_merged_and_verified(tmp_path):
    """Three shards built separately hold exactly i % 3 == I; merged, verified, they equal the source."""
    n = 200
    shards = [tmp_path / f"shard-{i}" for i in range(3)]
    for i, shard in enumerate(shards):
        cli("precompute", SPEC, str(shard), "--arg", f"n={n}", "--shard", f"{i}/3", "--workers", "1", "--quiet")
        keys = list(_registry.acquire(str(shard)).iter_keys())
        assert keys == list(range(i, n, 3))
    _registry._flush_all_at_exit()
    _registry._stores.clear()
    out = tmp_path / "merged"
    result = cli("merge", str(out), *map(str, shards), "--quiet")
    assert f"{n}/{n} samples (complete)" in result.stdout
    assert "all intact" in cli("verify", str(out), "--quiet").stdout
    check_cache(out, n)
    partial = tmp_path / "partial"
    result = cli("merge", str(partial), str(shards[0]), str(shards[2]), "--quiet")
    assert "incomplete: 67 indices missing" in result.stdout


def slow_precompute(cache_dir, n: int) -> subprocess.Popen:
    """A precompute of ``n`` samples at ~2 ms each on 2 workers, committing every 50: slow enough to interrupt."""
    return cli(
        "precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--arg", "delay=0.002", "--workers", "2",
        "--commit-every", "50", "--quiet", wait=False,
    )  # fmt: skip


def test_ctrl_c_keeps_what_was_decoded_and_resumes(cache_dir):
    """Ctrl-C exits 130 with a one-line summary of what was kept; the rerun finishes the job."""
    n = 3000
    with slow_precompute(cache_dir, n) as proc:
        wait_for_count(cache_dir, 100)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Interrupted: kept") and "Rerun" in lines[0]
    kept = CachedDataset.open(cache_dir)
    count = kept.cached_count
    kept.close()
    assert 100 <= count < n and f"now holds {count}/{n}" in lines[0]
    cli("precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--workers", "2", "--quiet")
    check_cache(cache_dir, n)


# Where the Ctrl-C lands: the precompute arguments after SPEC PATH, then when to send it: once the
# cache exists (None) or holds that many samples, and how long after that.
CTRL_C_PHASES = {
    # The parent decodes 3 indices twice at 0.5 s each, right after creating the cache.
    "determinism check": ("helpers:Synthetic", ["--arg", "n=100", "--arg", "delay=0.5"], None, 0.5),
    # The check writes its one sample, then the workers are started at once.
    "starting workers": ("helpers:Huge", ["--arg", "n=3000", "--arg", "nbytes=150528", "--check-determinism", "1"],
                         1, 0.0),
    # 150 KB samples fill the workers' result pipes: a worker interrupted mid-batch blocked on its
    # full pipe and the DataLoader waited 5 s for each before killing it (11 s with 2 workers).
    "decoding": ("helpers:Huge", ["--arg", "n=3000", "--arg", "nbytes=150528"], 200, 0.0),
}  # fmt: skip


def _last_commit_time(path: Path, proc: subprocess.Popen) -> float:
    """Poll ``path`` (read-only) until ``proc`` exits; return when its last commit was first seen."""
    seen, when = None, time.monotonic()
    while True:
        done = proc.poll() is not None
        try:
            with lmdb.open(str(path), max_dbs=2, readonly=True, lock=True) as env:
                txnid = env.info()["last_txnid"]
        except lmdb.Error:
            txnid = seen
        if txnid != seen:
            seen, when = txnid, time.monotonic()
        if done:
            return when
        time.sleep(0.01)


@pytest.mark.parametrize("phase", list(CTRL_C_PHASES))
def test_ctrl_c_exits_promptly_whatever_the_phase(cache_dir, phase):
    """A terminal's Ctrl-C (SIGINT to the whole process group) ends precompute within a second or so in every
    phase (bound: 3 s after the last commit), with the summary; its time covers the work, not the shutdown.

    The last commit writes what the workers had handed over (up to two commits' worth, 256 MB each by default),
    so its own time is the disk's: it is timed apart (by watching the cache's last transaction id) and only
    bounded loosely, so a slow shared disk does not pass for a slow shutdown, nor the other way round."""
    spec, args, count, delay = CTRL_C_PHASES[phase]
    started = time.monotonic()
    with cli("precompute", spec, str(cache_dir), *args, "--workers", "2", "--quiet", wait=False,
             start_new_session=True) as proc:  # fmt: skip
        if count is None:
            while not (cache_dir / "data.mdb").exists() and proc.poll() is None:
                time.sleep(0.005)
        else:
            wait_for_count(cache_dir, count)
        time.sleep(delay)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        committed = max(_last_commit_time(cache_dir, proc), signalled)
        exited = time.monotonic()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    timing = f"the last commit {committed - signalled:.1f} s after Ctrl-C, the exit {exited - committed:.1f} s after it"
    assert exited - committed < 3.0 and committed - signalled < 30.0, timing
    summary = re.fullmatch(r"Interrupted: kept (\d+) samples, .* in ([\d.]+) s .*", out.strip())
    assert summary is not None, out
    # The last commit counts; the shutdown does not.
    assert float(summary.group(2)) < committed - started + 1.0, f"{out.strip()}; {timing}"


def _flip_in_file(path: Path, marker: bytes) -> None:
    """Flip one bit in the middle of every copy of ``marker`` in the file (LMDB may keep a stale copy of a page)."""
    data = bytearray(path.read_bytes())
    at = data.find(marker)
    assert at >= 0
    while at >= 0:
        data[at + len(marker) // 2] ^= 0x01
        at = data.find(marker, at + 1)
    path.write_bytes(bytes(data))


def test_warm_reports_throughput(cache_dir):
    """warm reads the cache through and reports MB/s."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    result = cli("warm", str(cache_dir), "--quiet")
    assert "MB/s" in result.stdout and "page cache" in result.stdout


def test_load_spec_parses_json_arguments():
    """--arg values are JSON where they parse, strings otherwise."""
    ds = load_spec("helpers:Synthetic", {"n": 5, "delay": 0.0})
    assert len(ds) == 5
    assert parse_args_kv(["a=1", "b=[1, 2]", "c=hello", "d=", 'e="x"', "f=true"]) == {
        "a": 1, "b": [1, 2], "c": "hello", "d": "", "e": "x", "f": True,
    }  # fmt: skip


def test_lmdb_left_untouched_by_failed_commands(tmp_path):
    """A foreign LMDB environment is never modified by info/verify/precompute."""
    path = tmp_path / "foreign"
    with lmdb.open(str(path)) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    before = (path / "data.mdb").read_bytes()
    for args in (["info", str(path)], ["verify", str(path)], ["precompute", SPEC, str(path), "--arg", "n=3"]):
        assert "did not create" in one_line_error(cli(*args, check=1))
    assert (path / "data.mdb").read_bytes() == before


# ---------------------------------------------------------------------- one line for every error


def test_an_untranslated_lmdb_error_is_one_line(cache_dir, capsys, monkeypatch):
    """An lmdb.Error that escapes the store (a bug) is still one line on stderr, exit 1, asking for a report."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=5", "--quiet")

    def broken(path):
        raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")

    monkeypatch.setattr(tools._ops, "info", broken)  # where the command looks it up
    line = one_line_error(run_main(capsys, "info", str(cache_dir)))
    assert run_main(capsys, "info", str(cache_dir)).returncode == 1
    assert "MDB_CORRUPTED" in line and "bug" in line


@pytest.mark.parametrize("command", ["info", "verify", "warm", "copy", "merge"])
def test_a_hostile_data_file_is_one_line_for_every_command(tmp_path, command, capsys):
    """A data.mdb of garbage (as long as a real one) gives every command one line on stderr and exit 1."""
    path = tmp_path / "hostile"
    path.mkdir()
    (path / "data.mdb").write_bytes(bytes(range(256)) * 256)
    args = {"copy": [str(path), str(tmp_path / "to")], "merge": [str(tmp_path / "to"), str(path)]}
    result = cli(command, *args.get(command, [str(path)]), check=1)
    assert "damaged" in one_line_error(result) or "not an LMDB file" in one_line_error(result)
    assert not (tmp_path / "to").exists()


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--workers", "-1", "integer >= 0 (0 decodes in this process), not '-1'"),
        ("--workers", "two", "integer >= 0"),
        ("--batch-size", "0", "integer >= 1, not '0'"),
        ("--commit-every", "0", "integer >= 1, not '0'"),
        ("--check-determinism", "-1", "integer >= 0 (0 skips the check), not '-1'"),
        ("--fingerprint", "", "must not be empty"),
    ],
)
def test_bad_numbers_are_argparse_errors(cache_dir, capsys, option, value, expected):
    """An out-of-range precompute option is an argparse error (exit 2) naming it and its valid range, no traceback."""
    result = run_main(capsys, "precompute", SPEC, str(cache_dir), option, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {option}: " in errors[0] and expected in errors[0], result.stderr
    assert not cache_dir.exists()
    assert "0 decodes in this process" in " ".join(run_main(capsys, "precompute", "--help").stdout.split())


def test_precompute_help_prints_the_shard_rule_with_one_percent(capsys):
    """The precompute epilog reads `i % N` (RawDescriptionHelpFormatter prints it as written: no `%%`)."""
    text = run_main(capsys, "precompute", "--help").stdout
    assert "shard i % N." in text and "%%" not in text


def test_warm_warns_about_memory_on_stderr(cache_dir, capsys, monkeypatch):
    """warm's low-memory warning goes to stderr; stdout holds only the result."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    from lmdbcache.tools import cli as cli_module

    monkeypatch.setattr(cli_module, "_mem_available", lambda: 1)
    result = run_main(capsys, "warm", str(cache_dir), "--quiet")
    assert result.returncode == 0
    assert "larger than the free memory" in result.stderr and "warning" not in result.stdout
    assert result.stdout.startswith("Read ")


def test_cli_errors_name_cli_flags_not_python_arguments(capsys, cache_dir, tmp_path):
    """A mismatch seen from precompute says --overwrite; 'no cache at PATH' names lmdbcache precompute."""
    with CachedDataset(Synthetic(5), cache_dir) as ds:
        ds[0]
    line = one_line_error(run_main(capsys, "precompute", SPEC, str(cache_dir), "--arg", "n=6", "--workers", "0"))
    assert "--overwrite" in line and "overwrite=True" not in line
    line = one_line_error(run_main(capsys, "info", str(tmp_path / "nothing")))
    assert "lmdbcache precompute" in line and "overwrite=True" not in line


# ---------------------------------------------------------------------- a codec's module not installed


@pytest.fixture
def without_zstd(tmp_path) -> dict:
    """An environment whose interpreters (and their children) fail to `import zstandard`, as without the extra."""
    hidden = tmp_path / "hide-zstandard"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text('import sys\nsys.modules["zstandard"] = None  # import fails\n')
    return {"PYTHONPATH": os.pathsep.join([str(hidden), str(ROOT), str(TESTS)])}


def test_compress_without_its_module_is_refused_before_anything_is_created(cache_dir, without_zstd):
    """`--compress zstd` without zstandard: one line naming the extra to install, exit 1, and no cache left behind."""
    probe = subprocess.run([sys.executable, "-c", "import zstandard"], env={**os.environ, **without_zstd},
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "ModuleNotFoundError" in probe.stderr  # really hidden
    result = cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--compress", "zstd", env=without_zstd, check=1)
    line = one_line_error(result)
    assert line == (
        "lmdbcache precompute: error: `--compress zstd` needs the zstandard module: pip install 'lmdbcache[zstd]'."
    )
    assert not cache_dir.exists()


def test_compress_without_its_module_from_python_creates_nothing(cache_dir, monkeypatch):
    """CachedDataset(compress='zstd') and precompute without zstandard raise MissingExtraError and create nothing."""
    from lmdbcache import MissingExtraError
    from lmdbcache.format import _frames

    monkeypatch.setitem(sys.modules, "zstandard", None)
    _frames._module.cache_clear()  # forget a zstandard imported by an earlier test
    try:
        for build in (
            lambda: CachedDataset(Synthetic(20), cache_dir, compress="zstd"),
            lambda: precompute(Synthetic(20), cache_dir, num_workers=0, progress=False, compress="zstd"),
        ):
            with pytest.raises(MissingExtraError, match=r"compress='zstd' needs the zstandard module: pip install"):
                build()
            assert not cache_dir.exists()
    finally:
        _frames._module.cache_clear()


def test_info_works_on_a_cache_whose_codec_is_not_installed(cache_dir, without_zstd):
    """`info` reads a zstd cache without zstandard; commands that decode values refuse it naming the extra."""
    from helpers import Compressible

    precompute(Compressible(20), cache_dir, num_workers=0, progress=False, compress="zstd")
    result = cli("info", str(cache_dir), env=without_zstd)
    assert "20 (100.0%, complete)" in result.stdout and "zstd:3" in result.stdout
    line = one_line_error(cli("verify", str(cache_dir), "--quiet", env=without_zstd, check=1))
    assert "compressed with zstd" in line and "pip install 'lmdbcache[zstd]'" in line


def test_pack_on_an_existing_cache_names_the_flags(cache_dir, capsys):
    """`--pack K` over a cache packed otherwise is refused (exit 1) naming --pack and --overwrite; no --pack resumes."""
    precompute(Synthetic(60), cache_dir, num_workers=0, progress=False, shard=(0, 2))  # pack=64, the default
    result = run_main(capsys, "precompute", SPEC, str(cache_dir), "--arg", "n=60", "--workers", "0", "--pack", "0")
    line = one_line_error(result)
    assert "built with pack=64, not pack=0" in line and "Leave out --pack" in line and "--overwrite" in line
    assert result.returncode == 1
    result = run_main(capsys, "precompute", SPEC, str(cache_dir), "--arg", "n=60", "--workers", "0", "--quiet")
    assert result.returncode == 0 and "Wrote 30 samples, skipped 30" in result.stdout


def on_a_terminal(*args: str) -> list[str]:
    """Run ``lmdbcache ARGS`` under `script -q -c` (a pty reporting 0 columns); its output's non-empty lines."""
    import shlex
    import shutil as _shutil

    if _shutil.which("script") is None:
        pytest.skip("util-linux `script` is not installed")
    command = shlex.join([sys.executable, "-m", "lmdbcache", *args])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    out = subprocess.run(["script", "-q", "-c", command, "/dev/null"], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    return [line for line in out.stdout.replace("\r", "\n").splitlines() if line.strip()]


def test_progress_bar_shows_on_a_zero_column_terminal_and_agrees_with_the_summary(cache_dir):
    """Under `script -q -c` (a pty reporting 0 columns) the bar prints, and its total is the summary's count."""
    lines = on_a_terminal("precompute", SPEC, str(cache_dir), "--arg", "n=300", "--workers", "1")
    assert any("300/300" in line and "sample" in line for line in lines), lines[-5:]
    assert "Wrote 300 samples" in lines[-1]


def test_precompute_says_it_is_syncing_after_the_bar(cache_dir):
    """On a terminal, "Syncing to disk..." follows the full bar (which sits at 100% during the final sync)."""
    lines = on_a_terminal("precompute", SPEC, str(cache_dir), "--arg", "n=100", "--workers", "0")
    assert lines[-2:] == ["Syncing to disk...", lines[-1]] and "Wrote 100 samples" in lines[-1], lines[-5:]
    assert "100/100" in lines[-3]
    assert "Syncing" not in "".join(on_a_terminal("precompute", SPEC, str(cache_dir), "--arg", "n=100", "--quiet"))


def test_merge_bar_has_a_total_and_one_shard_is_singular(tmp_path):
    """merge's bar counts to the shards' total (N/N), and one shard is "Merged 1 shard"."""
    shard = tmp_path / "shard"
    precompute(Synthetic(40), shard, num_workers=0, progress=False, shard=(0, 2))
    lines = on_a_terminal("merge", str(tmp_path / "out"), str(shard))
    assert any("20/20" in line and "sample" in line for line in lines), lines[-5:]
    assert lines[-1].startswith(f"Merged 1 shard into '{tmp_path / 'out'}': 20/40 samples"), lines[-1]


def test_verify_bar_starts_with_its_total(tmp_path):
    """verify's bar appears with its total (never "0sample" at an unknown rate), and closes at 100%."""
    CachedDataset(Synthetic(30), str(tmp_path / "c")).__getitems__(list(range(30)))
    _registry._flush_all_at_exit()
    _registry._stores.clear()
    lines = on_a_terminal("verify", str(tmp_path / "c"))
    bars = [line for line in lines if "sample" in line and "Checked" not in line]
    assert bars and all("/30" in line for line in bars), lines
    assert any("30/30" in line for line in bars) and lines[-1].startswith("Checked 30 entries: all intact"), lines


def test_merge_into_a_cache_of_another_dataset_names_the_fixes_merge_has(tmp_path, capsys):
    """merge into an OUT of another dataset says delete it or use another path; it names no --overwrite or
    precompute, which merge has not and which would rebuild OUT from a source merge does not use."""
    shard = tmp_path / "shard"
    precompute(Synthetic(8), shard, num_workers=0, progress=False)
    CachedDataset(Synthetic(9), str(tmp_path / "out"))[0]
    _registry._flush_all_at_exit()
    _registry._stores.clear()
    line = one_line_error(run_main(capsys, "merge", str(tmp_path / "out"), str(shard), "--quiet"))
    assert "or use another path." in line and "overwrite" not in line and "precompute" not in line, line


# ---------------------------------------------------------------------- start-up cost

# `python -m lmdbcache ARGS` run as the command runs it (runpy), then: was torch imported?
NO_TORCH = """
import runpy, sys
sys.argv = ["lmdbcache", *sys.argv[1:]]
try:
    runpy.run_module("lmdbcache", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "torch not imported", code)
"""


def imports_torch(*args: str) -> str:
    """Run ``lmdbcache ARGS`` in a fresh interpreter; return its last line: whether torch was imported, the exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *args], env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_version_does_not_import_torch():
    """`lmdbcache --version` does not import torch (it took 2.7 s to print the version)."""
    assert imports_torch("--version") == "torch not imported 0"


def test_info_does_not_import_torch(cache_dir):
    """`lmdbcache info` on a cache does not import torch: commands on an existing cache start fast."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    assert imports_torch("info", str(cache_dir)) == "torch not imported 0"
