"""The ``lmdbcache`` command, run as real subprocesses on real caches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
from helpers import Synthetic, assert_same, sample_for, small_disk
from test_processes import check_cache, wait_for_count

from lmdbcache import CachedDataset, _registry, precompute
from lmdbcache.cli import load_spec

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
    from lmdbcache.cli import main

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
    assert (data["length"], data["cached"], data["format_version"]) == (300, 300, 1)
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


def test_bad_arguments_exit_2(cache_dir, capsys):
    """Malformed options are argparse errors (exit 2) with the reason."""
    result = run_main(capsys, "precompute", SPEC, str(cache_dir), "--shard", "3/3")
    assert result.returncode == 2 and "0 <= I < N" in result.stderr
    assert run_main(capsys, "precompute", SPEC, str(cache_dir), "--shard", "1-3").returncode == 2
    assert run_main(capsys, "frobnicate").returncode == 2


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


def test_merge_refuses_shards_of_different_datasets(tmp_path):
    """Shards with different fingerprints or lengths are refused, and nothing is merged."""
    a, b = tmp_path / "a", tmp_path / "b"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--shard", "0/2", "--quiet")
    cli("precompute", SPEC, str(b), "--arg", "n=31", "--shard", "1/2", "--quiet")
    line = one_line_error(cli("merge", str(tmp_path / "out"), str(a), str(b), check=1))
    assert "another dataset" in line and "Synthetic:31" in line
    assert not (tmp_path / "out").exists()


def slow_precompute(cache_dir, n: int) -> subprocess.Popen:
    """A precompute of ``n`` samples at ~2 ms each on 2 workers, committing every 50: slow enough to interrupt."""
    return cli(
        "precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--arg", "delay=0.002", "--workers", "2",
        "--commit-every", "50", "--quiet", wait=False,
    )  # fmt: skip


def test_sigkill_mid_precompute_then_resume(cache_dir):
    """A precompute SIGKILLed mid-run keeps every committed sample; rerunning completes the cache, all correct."""
    n = 1500
    with slow_precompute(cache_dir, n) as proc:
        wait_for_count(cache_dir, 200)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    partial = CachedDataset.open(cache_dir)
    committed = partial.cached_count
    partial.close()
    assert 200 <= committed < n
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    result = cli("precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--workers", "2", "--quiet")
    assert f"skipped {committed} already cached" in result.stdout
    check_cache(cache_dir, n)


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


def test_item_error_names_the_index_and_keeps_the_rest(cache_dir):
    """A dataset item that raises stops precompute with exit 1 naming index and exception; the cache stays sound."""
    line = one_line_error(
        cli("precompute", "helpers:Failing", str(cache_dir), "--arg", "n=64", "--arg", "bad=40", check=1)
    )
    assert "index 40" in line and "ValueError: cannot decode file 40" in line and "rerun" in line
    ds = CachedDataset.open(cache_dir)
    assert 0 < ds.cached_count < 64
    for index in ds._live_store().iter_keys():
        assert index != 40
        assert_same(ds[index], sample_for(index))
    ds.close()


def test_existing_cache_of_another_dataset(cache_dir):
    """precompute onto a cache built for another dataset is the mismatch error, and changes nothing."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    line = one_line_error(cli("precompute", SPEC, str(cache_dir), "--arg", "n=21", check=1))
    assert "length 20 but the dataset has length 21" in line and "overwrite" in line
    check_cache(cache_dir, 20)
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=21", "--overwrite", "--quiet")
    check_cache(cache_dir, 21)


def test_determinism_guard(cache_dir):
    """A dataset whose samples vary between calls is refused with advice; --allow-nondeterministic overrides."""
    line = one_line_error(cli("precompute", "helpers:Noisy", str(cache_dir), check=1))
    assert "different samples for index 0" in line and "transform" in line and "--allow-nondeterministic" in line
    cli("precompute", "helpers:Noisy", str(cache_dir), "--allow-nondeterministic", "--quiet")
    assert CachedDataset.open(cache_dir).is_complete


def _flip_in_file(path: Path, marker: bytes) -> None:
    """Flip one bit in the middle of every copy of ``marker`` in the file (LMDB may keep a stale copy of a page)."""
    data = bytearray(path.read_bytes())
    at = data.find(marker)
    assert at >= 0
    while at >= 0:
        data[at + len(marker) // 2] ^= 0x01
        at = data.find(marker, at + 1)
    path.write_bytes(bytes(data))


def test_verify_finds_a_corrupted_value_and_repair_refills(cache_dir):
    """A byte flipped inside one stored value: verify exits 1 naming its index; --repair deletes it; it refills."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    marker = bytes(sample_for(17)[0].flatten().tolist())  # the raw pixels of index 17, unique in the file
    _flip_in_file(cache_dir / "data.mdb", marker)
    result = cli("verify", str(cache_dir), "--quiet", check=1)
    assert "1 damaged: 17." in result.stdout
    ds = CachedDataset(Synthetic(50), cache_dir)
    with pytest.raises(Exception, match="index 17 is damaged"):
        ds[17]
    ds.close()
    _registry._stores.clear()
    assert "deleted 1 damaged (17)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    check_cache(cache_dir, 50)


def test_warm_reports_throughput(cache_dir):
    """warm reads the cache through and reports MB/s."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    result = cli("warm", str(cache_dir), "--quiet")
    assert "MB/s" in result.stdout and "page cache" in result.stdout


def test_copy_during_a_concurrent_fill(tmp_path):
    """Copies taken while another process fills the source are consistent caches; a later copy completes it."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    n = 1200
    with cli(
        "precompute", SPEC, str(src), "--arg", f"n={n}", "--arg", "delay=0.002", "--workers", "1",
        "--commit-every", "40", "--quiet", wait=False,
    ) as filler:  # fmt: skip
        wait_for_count(src, 80)
        counts = []
        while filler.poll() is None and len(counts) < 4:
            result = cli("copy", str(src), str(dst))
            assert "Traceback" not in result.stderr
            assert "all intact" in cli("verify", str(dst), "--quiet").stdout
            counts.append(json.loads(cli("info", str(dst), "--json").stdout)["cached"])
            time.sleep(0.2)
        _, err = filler.communicate(timeout=120)
        assert filler.returncode == 0, err
    assert counts and counts == sorted(counts) and counts[0] < n
    assert "Replaced" in cli("copy", str(src), str(dst)).stdout or counts[-1] == n
    assert "nothing to do" in cli("copy", str(src), str(dst)).stdout
    check_cache(dst, n)
    other = tmp_path / "other"
    cli("precompute", SPEC, str(other), "--arg", "n=10", "--quiet")
    assert "another dataset" in one_line_error(cli("copy", str(other), str(dst), check=1))
    cli("copy", str(other), str(dst), "--overwrite")
    check_cache(dst, 10)


def test_precompute_on_a_full_disk(tmp_path):
    """On a disk that fills up, precompute exits 1 saying so (path, free space); the cache stays consistent."""
    with small_disk(tmp_path, "24m") as mount:
        cache = mount / "cache"
        line = one_line_error(
            cli("precompute", "helpers:Big", str(cache), "--arg", "n=64", "--commit-every", "4", check=1)
        )
        assert "is full" in line and str(mount) in line and "bytes free" in line
        assert "all intact" in cli("verify", str(cache), "--quiet").stdout
        ds = CachedDataset.open(cache)
        assert 0 < ds.cached_count < 64
        ds.close()


def test_torchrun_local_ranks_split_the_work(cache_dir):
    """With LOCAL_RANK/LOCAL_WORLD_SIZE set (torchrun), two processes share the work of one node-local cache."""
    n = 400
    procs = []
    for rank in range(2):
        env = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(
            cli("precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--workers", "1", "--quiet", wait=False, env=env)
        )
    written = []
    for proc in procs:
        with proc:
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        written.append(int(out.split()[1]))
    assert sum(written) == n and all(w == n // 2 for w in written)
    check_cache(cache_dir, n)


def test_python_api_precompute(cache_dir):
    """lmdbcache.precompute works from a notebook: same result object the command prints."""
    result = precompute(Synthetic(120), cache_dir, num_workers=0, progress=False)
    assert (result.written, result.skipped, result.cached, result.length) == (120, 0, 120, 120)
    assert "Wrote 120 samples" in result.summary()
    again = precompute(Synthetic(120), cache_dir, num_workers=2, progress=False)
    assert (again.written, again.skipped) == (0, 120)
    check_cache(cache_dir, 120)


def test_load_spec_parses_json_arguments():
    """--arg values are JSON where they parse, strings otherwise."""
    ds = load_spec("helpers:Synthetic", {"n": 5, "delay": 0.0})
    assert len(ds) == 5
    from lmdbcache.cli import _parse_args_kv

    assert _parse_args_kv(["a=1", "b=[1, 2]", "c=hello", "d=", 'e="x"', "f=true"]) == {
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
