"""``precompute``: the Python API, and builds by the command (checks, errors, kills, shards of a node)."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections import Counter

import pytest
import torch
from helpers import (
    TAG,
    Synthetic,
    assert_none_outlive,
    assert_same,
    held_children,
    reads_by_rank,
    sample_for,
    small_disk,
)
from test_cli import SPEC, cli, one_line_error, slow_precompute
from test_commit import wait_until
from test_processes import check_cache, wait_for_count

from lmdbcache import CachedDataset, CacheMismatchError, precompute, tools
from lmdbcache.store import _registry


def test_python_api_precompute(cache_dir):
    """lmdbcache.precompute works from a notebook: same result object the command prints."""
    result = precompute(Synthetic(120), cache_dir, num_workers=0, progress=False)
    assert (result.written, result.skipped, result.cached, result.length) == (120, 0, 120, 120)
    assert "Wrote 120 samples" in result.summary()
    again = precompute(Synthetic(120), cache_dir, num_workers=2, progress=False)
    assert (again.written, again.skipped) == (0, 120)
    check_cache(cache_dir, 120)


def test_determinism_guard(cache_dir):
    """A dataset whose samples vary between calls is refused with advice; --allow-nondeterministic overrides."""
    line = one_line_error(cli("precompute", "helpers:Noisy", str(cache_dir), check=1))
    assert "different samples for index 0" in line and "transform" in line and "--allow-nondeterministic" in line
    cli("precompute", "helpers:Noisy", str(cache_dir), "--allow-nondeterministic", "--quiet")
    assert CachedDataset.open(cache_dir).is_complete


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


def test_existing_cache_of_another_dataset(cache_dir):
    """precompute onto a cache built for another dataset is the mismatch error, and changes nothing."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    line = one_line_error(cli("precompute", SPEC, str(cache_dir), "--arg", "n=21", check=1))
    assert "length 20 but the dataset has length 21" in line and "overwrite" in line
    check_cache(cache_dir, 20)
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=21", "--overwrite", "--quiet")
    check_cache(cache_dir, 21)


RESIZED = "test_dataset:Resized"  # same class and length, another output size: only the spot check tells


def test_precompute_spot_checks_an_existing_cache(cache_dir):
    """precompute over a cache built with other preprocessing (same class and length) fails, exit 1, naming the fix."""
    cli("precompute", RESIZED, str(cache_dir), "--arg", "n=30", "--arg", "size=8", "--workers", "0", "--quiet")
    smaller = ("precompute", RESIZED, str(cache_dir), "--arg", "n=30", "--arg", "size=6", "--workers", "0")
    line = one_line_error(cli(*smaller, check=1))
    assert "does not match its source dataset at index" in line and "[3, 8, 8] in the cache" in line
    assert "--overwrite" in line and "--fingerprint" in line and "overwrite=True" not in line
    with CachedDataset.open(cache_dir) as ds:
        assert ds.is_complete and ds[0][0].shape == (3, 8, 8)  # untouched
    assert "Wrote 30 samples" in cli(*smaller, "--overwrite", "--quiet").stdout
    with CachedDataset.open(cache_dir) as ds:
        assert ds[29][0].shape == (3, 6, 6)


def test_precompute_spot_check_from_python_and_turned_off(cache_dir):
    """lmdbcache.precompute spot-checks as the command does, a partial cache too; spot_check=0 skips the check."""
    from test_dataset import Resized

    precompute(Resized(40, 8), cache_dir, num_workers=0, progress=False, shard=(0, 4))  # 10 of 40 cached
    with pytest.raises(CacheMismatchError, match=r"at index \d+: .*overwrite=True.*spot_check=0"):
        precompute(Resized(40, 6), cache_dir, num_workers=0, progress=False)
    assert precompute(Resized(40, 8), cache_dir, num_workers=0, progress=False, spot_check=5).written == 30
    result = precompute(Resized(40, 6), cache_dir, num_workers=0, progress=False, spot_check=0)
    assert (result.written, result.skipped) == (0, 40)  # the documented way out: nothing checked, nothing written


def test_pack_on_an_existing_cache_with_another_setting_is_refused(cache_dir):
    """pack= that differs from an existing cache's is CacheMismatchError, as compress= is; None keeps the cache's."""
    precompute(Synthetic(100), cache_dir, num_workers=0, progress=False, pack=0, shard=(0, 2))
    with pytest.raises(CacheMismatchError, match=r"built with no packs \(pack=0\), not pack=8.*overwrite=True"):
        precompute(Synthetic(100), cache_dir, num_workers=0, progress=False, pack=8)
    assert precompute(Synthetic(100), cache_dir, num_workers=0, progress=False, pack=0).written == 50
    with pytest.raises(CacheMismatchError, match="not pack=64"):
        precompute(Synthetic(100), cache_dir, num_workers=0, progress=False, pack=64)
    assert precompute(Synthetic(100), cache_dir, num_workers=0, progress=False).skipped == 100
    assert tools.info(cache_dir).pack == 0


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


@pytest.mark.parametrize("moment", ["forking", "forked", "running"])
def test_no_worker_outlives_a_sigkilled_precompute(cache_dir, tmp_path, moment):
    """precompute SIGKILLed as its first worker forks, with both forked and not yet started, or while they decode:
    every process of it ends (a worker started after its parent's death polled for it forever, issue 38)."""
    tag, hold = uuid.uuid4().hex, tmp_path / "hold"
    hold.mkdir()
    spec = (SPEC,) if moment == "running" else ("helpers:HeldAtFork", "--arg", f"hold_dir={json.dumps(str(hold))}")
    proc = cli("precompute", *spec, str(cache_dir), "--arg", "n=3000", "--arg", "delay=0.002", "--workers", "2",
               "--commit-every", "50", "--quiet", wait=False, env={TAG: tag})  # fmt: skip
    with proc:
        if moment == "running":
            wait_for_count(cache_dir, 100)
        else:
            assert wait_until(lambda: len(held_children(str(hold))) >= (1 if moment == "forking" else 2), 120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    (hold / "go").touch()  # held workers go on, into their first step, with their parent gone
    assert_none_outlive(tag)


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


def test_torchrun_ranks_never_decode_each_others_indices(cache_dir, tmp_path):
    """Two local ranks over a half-filled cache: each index is decoded by one rank only, its spot check and its
    determinism check included, and twice only for that rank's determinism check (issue 38)."""
    n, check = 120, 3
    with CachedDataset(Synthetic(n), cache_dir) as ds:
        for i in range(50):
            ds[i]
    counts = tmp_path / "counts"
    counts.mkdir()
    args = ("--arg", f"n={n}", "--arg", f"count_dir={json.dumps(str(counts))}", "--workers", "1", "--quiet")
    checks = ("--spot-check", "20", "--check-determinism", str(check))
    procs = []
    for rank in range(2):
        env = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(cli("precompute", SPEC, str(cache_dir), *args, *checks, wait=False, env=env))
    for proc in procs:
        with proc:
            _, err = proc.communicate(timeout=120)
    assert [proc.returncode for proc in procs] == [0, 0], err
    reads = reads_by_rank(str(counts))
    assert sorted(reads) == [0, 1]
    for rank, indices in reads.items():
        assert {i % 2 for i in indices} == {rank}  # rank r of 2 owns i % 2 == r, checks included
        todo = list(range(50 + rank, n, 2))
        twice = sorted(i for i, k in Counter(indices).items() if k == 2)
        assert twice == todo[:check] and max(Counter(indices).values()) == 2
        assert len([i for i in indices if i < 50]) == 20  # its spot check: 20 of its own 25 cached indices
        assert set(todo) <= set(indices)
    check_cache(cache_dir, n)


def test_precompute_resumes_a_grouped_lazy_fill(cache_dir):
    """precompute over a cache half filled lazily in shuffled order (groups, format 4) decodes only the missing
    indices, keeps the cache's own layout (no packs), and leaves every index once, nothing orphaned."""
    from test_compact import assert_nothing_orphaned
    from test_tools import _grouped

    n = 300
    _grouped(cache_dir, n, 5, range(0, n, 3))
    result = precompute(Synthetic(n), cache_dir, num_workers=0, progress=False, check_determinism=0)
    assert result.skipped == 100 and result.written == 200
    _registry._stores.clear()
    assert sorted(assert_nothing_orphaned(cache_dir)) == list(range(n))
    check_cache(cache_dir, n)


@pytest.mark.parametrize("quiet", [False, True])
def test_ctrl_c_says_what_it_still_writes(cache_dir, monkeypatch, capsys, quiet):
    """After Ctrl-C precompute writes what the workers handed over (up to two 256 MB commits' worth, seconds on a
    slow disk), and on a terminal it says so, with the amount, so the Ctrl-C does not seem to go unheard."""
    import sys

    from lmdbcache.format.codec import encode
    from lmdbcache.tools import _precompute

    source = Synthetic(40)
    run = _precompute._Run.open(str(cache_dir), source, 40, None, False, 1 << 30, 10**9, 1 << 30)
    values = [encode(source[i], i) for i in range(40)]
    for i, value in enumerate(values):
        run.store.add(i, value, build=run.build, policy=run.policy)
    assert run.store.writer.unwritten_bytes == sum(map(len, values))
    monkeypatch.setattr(_precompute, "_SAY_WRITING", sum(map(len, values)))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    run.final_commit(quiet)
    said = capsys.readouterr().err
    mb = f"{sum(map(len, values)) / 2**20:,.0f} MB"
    assert said == ("" if quiet else f"Interrupted: writing the {mb} decoded so far before stopping (a second "
                                     "Ctrl-C does not stop this)...\n")  # fmt: skip
    assert run.store.writer.unwritten_bytes == 0 and run.written == 40
    check_cache(cache_dir, 40)
