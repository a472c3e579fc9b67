"""The ``lmdbcache`` command, run as real subprocesses on real caches."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch
from helpers import Synthetic, assert_same, sample_for, small_disk
from test_processes import check_cache, wait_for_count

from lmdbcache import (
    FORMAT_VERSION,
    CachedDataset,
    CacheMismatchError,
    SampleNotCachedError,
    _registry,
    precompute,
    tools,
)
from lmdbcache._scan import TEST_SIGNAL
from lmdbcache._spec import load_spec, parse_args_kv

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


# Where the Ctrl-C lands: the precompute arguments after SPEC PATH, and what to wait for before it.
CTRL_C_PHASES = {
    # The parent decodes 3 indices twice at 0.3 s each: signalled 0.3 s after the cache is created.
    "determinism check": ("helpers:Synthetic", ["--arg", "n=100", "--arg", "delay=0.3"], "created", 0.3),
    # No check: the workers are being started (or send their first batch) when the cache appears.
    "starting workers": ("helpers:Huge", ["--arg", "n=3000", "--arg", "nbytes=150528", "--check-determinism", "0"],
                         "created", 0.0),
    # 150 KB samples fill the workers' result pipes: a worker interrupted mid-batch blocked on its
    # full pipe and the DataLoader waited 5 s for each before killing it (11 s with 2 workers).
    "decoding": ("helpers:Huge", ["--arg", "n=3000", "--arg", "nbytes=150528"], "200 samples", 0.0),
}  # fmt: skip


@pytest.mark.parametrize("phase", list(CTRL_C_PHASES))
def test_ctrl_c_exits_promptly_whatever_the_phase(cache_dir, phase):
    """A terminal's Ctrl-C (SIGINT to the whole process group) ends precompute within a second or so in every
    phase (bound: 3 s), with the summary; its time covers the work, not the shutdown."""
    spec, args, wait, delay = CTRL_C_PHASES[phase]
    started = time.monotonic()
    with cli("precompute", spec, str(cache_dir), *args, "--workers", "2", "--quiet", wait=False,
             start_new_session=True) as proc:  # fmt: skip
        if wait == "created":
            while not (cache_dir / "data.mdb").exists() and proc.poll() is None:
                time.sleep(0.005)
        else:
            wait_for_count(cache_dir, 200)
        time.sleep(delay)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert took < 3.0, f"exited {took:.1f} s after Ctrl-C"
    summary = re.fullmatch(r"Interrupted: kept (\d+) samples, .* in ([\d.]+) s .*", out.strip())
    assert summary is not None, out
    assert float(summary.group(2)) < signalled - started + 1.0  # the last commit counts; the shutdown does not


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


# ---------------------------------------------------------------------- copy touches only the cache's files


def partial_cache(path: Path, n: int, filled: int, *, beside: bool = False) -> None:
    """A cache of Synthetic(n) holding ``filled`` indices; ``beside``: created among other files (README recipe)."""
    ds = CachedDataset(Synthetic(n), path, overwrite=beside)
    for i in range(filled):
        ds[i]
    ds.close()


def test_copy_leaves_every_other_file_in_the_destination(tmp_path):
    """copy replaces only the cache's own files in DST: other files and folders survive, nothing is moved aside."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cli("precompute", SPEC, str(src), "--arg", "n=30", "--quiet")
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    (dst / "runs").mkdir()
    (dst / "runs" / "log").write_text("and me")
    partial_cache(dst, 30, 5, beside=True)
    assert "Replaced" in cli("copy", str(src), str(dst)).stdout
    check_cache(dst, 30)
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "runs" / "log").read_text() == "and me"
    assert sorted(os.listdir(dst)) == ["data.mdb", "lmdbcache.lock", "lock.mdb", "notes.txt", "runs"]
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]  # no dst.old-PID, no dst.copy-PID
    other = tmp_path / "other"
    cli("precompute", SPEC, str(other), "--arg", "n=10", "--quiet")
    cli("copy", str(other), str(dst), "--overwrite")
    check_cache(dst, 10)
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "runs" / "log").read_text() == "and me"
    plain = tmp_path / "plain"  # other files and no cache: only with --overwrite, beside them
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    assert "holds no lmdbcache cache" in one_line_error(cli("copy", str(src), str(plain), check=1))
    assert os.listdir(plain) == ["notes.txt"]
    cli("copy", str(src), str(plain), "--overwrite")
    check_cache(plain, 30)
    assert (plain / "notes.txt").read_text() == "mine"


def test_copy_refuses_a_file_or_a_link_to_one_as_destination(tmp_path):
    """A regular file (or a symlink to one) as DST is refused in one line and left exactly as it was."""
    src = tmp_path / "src"
    cli("precompute", SPEC, str(src), "--arg", "n=10", "--quiet")
    target = tmp_path / "results.csv"
    target.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    for dst in (target, link):
        assert "is a file, not a directory" in one_line_error(cli("copy", str(src), str(dst), check=1))
    assert target.read_text() == "precious" and os.readlink(link) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["link", "results.csv", "src"]


def test_copy_over_a_cache_in_use_keeps_its_readers_on_the_old_file(tmp_path):
    """A process reading DST when copy replaces it keeps reading the old file (never the new bytes); copy says so."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cli("precompute", SPEC, str(src), "--arg", "n=30", "--quiet")
    partial_cache(dst, 30, 10)
    reader = CachedDataset.open(dst)
    assert_same(reader[3], sample_for(3))
    result = cli("copy", str(src), str(dst))
    assert "Replaced" in result.stdout and "other processes had the old cache" in result.stderr
    for i in range(10):
        assert_same(reader[i], sample_for(i))
    with pytest.raises(SampleNotCachedError):
        reader[20]  # cached only in the new file
    reader.close()
    _registry._stores.clear()
    check_cache(dst, 30)


# ---------------------------------------------------------------------- verify survives what kills a reader


def crashing_cache(path: Path, after: int = 6) -> None:
    """A cache whose leaf page points the node after index ``after`` 64 KiB on, past the end of data.mdb.

    LMDB trusts the node offsets in a page: reading that key runs off the end of the file (SIGBUS).
    """
    precompute(Synthetic(20), path, num_workers=0, check_determinism=0, progress=False)
    data = bytearray((path / "data.mdb").read_bytes())
    node = b"\x00\x00\x08\x00" + struct.pack(">Q", after + 1)  # a leaf node's flags (0), key size (8), key
    at, patched = data.find(node), 0
    while at >= 0:
        page = at // 4096 * 4096
        lower = struct.unpack_from("<H", data, page + 12)[0]  # the page header's end of the offsets table
        offsets = [page + 16 + 2 * i for i in range((lower - 16) // 2)]
        for where in offsets:
            if struct.unpack_from("<H", data, where)[0] == at - 4 - page:
                assert page + 0xFFF8 > len(data)
                struct.pack_into("<H", data, where, 0xFFF8)
                patched += 1
        at = data.find(node, at + 1)
    assert patched
    (path / "data.mdb").write_bytes(bytes(data))


def test_verify_survives_a_file_that_crashes_the_reader(cache_dir):
    """A data.mdb that makes LMDB's C code fault: verify exits 1 saying where and how; --repair changes nothing."""
    crashing_cache(cache_dir)
    before = (cache_dir / "data.mdb").read_bytes()
    result = cli("verify", str(cache_dir), check=1)
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stdout.strip()
    assert re.fullmatch(
        r"damaged: the LMDB file crashed the reader at the entry after index 6 \(after 7 good entries\) with "
        r"SIG(BUS|SEGV); copy the cache from a good replica, or rebuild it \(`lmdbcache precompute --overwrite`\)\.",
        line,
    ), line
    result = cli("verify", str(cache_dir), "--repair", "--quiet", check=1)
    assert "crashed the reader at the entry after index 6" in result.stdout
    assert "nothing was deleted" in result.stdout
    assert (cache_dir / "data.mdb").read_bytes() == before


def test_verify_reports_where_a_killed_reader_died(cache_dir, monkeypatch):
    """A reader killed by a signal (sent by a test hook) is reported with the index, the good entries and the signal."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    result = cli("verify", str(cache_dir), "--quiet", check=1, env={TEST_SIGNAL: "SIGSEGV@5"})
    assert result.stdout.startswith(
        "damaged: the LMDB file crashed the reader at index 5 (after 5 good entries) with SIGSEGV; copy"
    )
    assert "Traceback" not in result.stderr
    monkeypatch.setenv(TEST_SIGNAL, "SIGKILL@3")
    found = tools.verify(cache_dir, repair=True)
    assert (found.checked, found.bad, found.repaired) == (3, [], 0) and not found.intact
    assert found.crashed is not None and "at index 3 (after 3 good entries) by SIGKILL" in found.crashed
    monkeypatch.delenv(TEST_SIGNAL)
    assert tools.verify(cache_dir).intact


def damage_entries(path: Path, edit) -> None:
    """Open the cache's LMDB environment directly and let ``edit(txn)`` change the samples database."""
    with lmdb.open(str(path), max_dbs=2) as env:
        db = env.open_db(b"samples")
        with env.begin(write=True, db=db) as txn:
            edit(txn)


def key(index: int) -> bytes:
    return struct.pack(">Q", index)


def test_verify_binds_each_value_to_its_index(cache_dir):
    """A sound value stored under another index, or an index outside the dataset, is damage; --repair deletes it."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    damage_entries(cache_dir, lambda txn: (txn.put(key(4), txn.get(key(3))), txn.put(key(25), txn.get(key(5)))))
    assert "2 damaged: 4, 25." in cli("verify", str(cache_dir), "--quiet", check=1).stdout
    assert "deleted 2 damaged (4, 25)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    assert "Checked 19 entries: all intact" in cli("verify", str(cache_dir), "--quiet").stdout


def test_verify_stops_at_a_key_that_is_not_an_index(cache_dir):
    """A key that is not 8 bytes is damage verify reports (with what came before), not an error; nothing is deleted."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    between = key(9) + b"!"  # sorts between the keys of indices 9 and 10: a scan must not step over it
    damage_entries(cache_dir, lambda txn: (txn.put(key(4), txn.get(key(3))), txn.put(between, b"hostile")))
    result = cli("verify", str(cache_dir), "--repair", "--quiet", check=1)
    assert "Traceback" not in result.stderr and not result.stderr.strip()
    out = result.stdout.strip()
    assert out.startswith("damaged: the scan cannot read past index 9 (after 9 good entries):"), out
    assert "key of 9 bytes" in out and "nothing was deleted" in out and out.endswith("before it: 4.")
    first = cache_dir.parent / "first"  # a key that sorts before index 0, out of reach of a scan by index
    cli("precompute", SPEC, str(first), "--arg", "n=20", "--shard", "0/2", "--quiet")
    damage_entries(first, lambda txn: txn.put(b"\x00", b"hostile"))
    out = cli("verify", str(first), "--quiet", check=1).stdout
    assert out.startswith("damaged: after 10 good entries, it held 11 entries when the scan began but only 10"), out


# ---------------------------------------------------------------------- one line for every error


def test_an_untranslated_lmdb_error_is_one_line(cache_dir, capsys, monkeypatch):
    """An lmdb.Error that escapes the store (a bug) is still one line on stderr, exit 1, asking for a report."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=5", "--quiet")

    def broken(path):
        raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")

    monkeypatch.setattr(tools, "info", broken)
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
    from lmdbcache import cli as cli_module

    monkeypatch.setattr(cli_module, "_mem_available", lambda: 1)
    result = run_main(capsys, "warm", str(cache_dir), "--quiet")
    assert result.returncode == 0
    assert "larger than the free memory" in result.stderr and "warning" not in result.stdout
    assert result.stdout.startswith("Read ")


# ---------------------------------------------------------------------- merge


def test_merge_refuses_a_shard_twice_or_the_output_as_a_shard(tmp_path):
    """The same shard listed twice (by any path) or OUT among the shards is refused in one line, writing nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--shard", "0/2", "--quiet")
    cli("precompute", SPEC, str(b), "--arg", "n=30", "--shard", "1/2", "--quiet")
    (tmp_path / "alias").symlink_to(a)
    out = tmp_path / "out"
    assert "listed twice" in one_line_error(cli("merge", str(out), str(a), str(b), str(a), check=1))
    line = one_line_error(cli("merge", str(out), str(a), str(tmp_path / "alias"), check=1))
    assert "listed twice" in line and f"the same as '{a}'" in line
    assert not out.exists()
    before = (a / "data.mdb").read_bytes()
    assert "merged cache itself" in one_line_error(cli("merge", str(a), str(a), str(b), check=1))
    assert (a / "data.mdb").read_bytes() == before


def test_merge_verifies_each_value_against_its_index(tmp_path):
    """A shard value stored under another index stops merge with one line naming the shard and the index."""
    a = tmp_path / "a"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--quiet")
    damage_entries(a, lambda txn: txn.put(key(6), txn.get(key(2))))
    line = one_line_error(cli("merge", str(tmp_path / "out"), str(a), "--quiet", check=1))
    assert f"Shard '{a}': index 6 is damaged" in line and "verify --repair" in line


def test_determinism_check_samples_never_reach_a_build_made_meanwhile(cache_dir):
    """precompute's first samples are written with its build id: a rebuild in between makes it fail, not mix."""
    from helpers import Listed

    with CachedDataset(Synthetic(20), cache_dir) as ds:
        ds[0]
    store = _registry.acquire(str(cache_dir))
    build = store.initialize(length=20, fingerprint="Synthetic:20")["cache_id"]
    CachedDataset(Listed([(torch.zeros(1), k) for k in range(20)]), cache_dir, fingerprint="Synthetic:20",
                  overwrite=True).close()  # fmt: skip
    from lmdbcache.codec import encode

    with pytest.raises(CacheMismatchError, match="rebuilt"):
        store.put_many([(5, encode(sample_for(5), 5))], build)
    _registry.release(store)


def test_cli_errors_name_cli_flags_not_python_arguments(capsys, cache_dir, tmp_path):
    """A mismatch seen from precompute says --overwrite; 'no cache at PATH' names lmdbcache precompute."""
    with CachedDataset(Synthetic(5), cache_dir) as ds:
        ds[0]
    line = one_line_error(run_main(capsys, "precompute", SPEC, str(cache_dir), "--arg", "n=6", "--workers", "0"))
    assert "--overwrite" in line and "overwrite=True" not in line
    line = one_line_error(run_main(capsys, "info", str(tmp_path / "nothing")))
    assert "lmdbcache precompute" in line and "overwrite=True" not in line


def test_a_killed_precompute_loses_about_a_second_of_work(cache_dir):
    """precompute commits on time too: with --commit-every far above the run, a SIGKILL still keeps the work."""
    n = 4000
    proc = cli("precompute", SPEC, str(cache_dir), "--arg", f"n={n}", "--arg", "delay=0.004", "--workers", "2",
               "--commit-every", "100000", "--quiet", wait=False)  # fmt: skip
    with proc:
        wait_for_count(cache_dir, 100)  # only a timed commit can get there (v0.1.0 kept 3 of 1,500)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with CachedDataset.open(cache_dir) as partial:
        assert 100 <= partial.cached_count < n


def test_progress_bar_shows_on_a_zero_column_terminal_and_agrees_with_the_summary(cache_dir):
    """Under `script -q -c` (a pty reporting 0 columns) the bar prints, and its total is the summary's count."""
    import shutil as _shutil

    if _shutil.which("script") is None:
        pytest.skip("util-linux `script` is not installed")
    command = f"{sys.executable} -m lmdbcache precompute {SPEC} {cache_dir} --arg n=300 --workers 1"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    out = subprocess.run(["script", "-q", "-c", command, "/dev/null"], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    lines = [line for line in out.stdout.replace("\r", "\n").splitlines() if line.strip()]
    assert any("300/300" in line and "sample" in line for line in lines), lines[-5:]
    assert "Wrote 300 samples" in lines[-1]


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


@pytest.mark.xfail(strict=True, reason="codec imports torch until the codec split lands")
def test_info_does_not_import_torch(cache_dir):
    """`lmdbcache info` on a cache does not import torch: commands on an existing cache start fast."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    assert imports_torch("info", str(cache_dir)) == "torch not imported 0"
