"""The benchmark runs end to end at tiny sizes, so `make bench` cannot rot."""

from __future__ import annotations

import json

import pytest

from bench import hash_copy, run
from lmdbcache import _native


def test_bench_runs_at_tiny_sizes_and_writes_its_three_files(tmp_path):
    """bench.run --tiny measures every available system on every workload and writes md, json and png."""
    out = tmp_path / "results"
    results = run.main(["--tiny", "--work", str(tmp_path / "work"), "--out", str(out), "--quiet"])
    assert {p.name for p in out.iterdir()} == {"latest.md", "latest.json", "latest.png"}
    assert (out / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "latest.json").read_text())
    assert set(data["workloads"]) == {"jpeg", "small", "dict"}
    assert {"cpu", "cores", "ram_bytes", "versions"} <= set(data["machine"])
    assert {"python", "torch", "lmdb"} <= set(data["machine"]["versions"])
    for name, workload in data["workloads"].items():
        systems = workload["systems"]
        assert {"bare", "lmdbcache", "dict-per-process"} <= set(systems)
        assert ("memmap" in systems) == (name != "dict")
        for system, entry in systems.items():
            assert entry["first_epoch"] > 0 and entry["warm_1proc"]["median"] > 0
            assert entry["warm_loader"]["median"] > 0 and entry["pss_bytes"] > 0
            assert ("fresh_rate" in entry) == (system in ("lmdbcache", "memmap", "diskcache", "hf-datasets"))
    first = data["first_epochs"]
    assert set(first["workloads"]) == {"png", "jpeg", "dict"} and set(first["miss_us"]) == {"1 KiB", "3 KiB", "6 KiB"}
    for entry in first["workloads"].values():
        for order in ("in_order", "shuffled"):
            assert entry[order]["bare"]["median"] > 0 and entry[order]["fill"]["median"] > 0
    assert all(entry["fill_us"] > 0 for entry in first["miss_us"].values())
    text = (out / "latest.md").read_text()
    assert "## First epochs" in text and "per-miss overhead, 3 KiB samples" in text
    assert "## lmdbcache targets" in text and "## How to read this" in text
    assert "returns the stored object itself" in text  # the rows a reader could misread are explained
    assert results["skipped"] == data["skipped"]
    for name in data["skipped"]:
        assert f"- {name}:" in text


@pytest.mark.skipif(_native.core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
def test_hash_copy_runs_at_tiny_sizes(tmp_path, capsys):
    """bench.hash_copy times its three variants (and another build's, with --so) and checks their digests first."""
    hash_copy.main(
        ["--n", "40", "--side", "16", "--reps", "2", "--root", str(tmp_path), "--so", f"again={_native.core.__file__}"]
    )
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ")[0] for line in lines[1:-1]]
    assert names == ["copy only", "copy, then xxh3_64", "xxh3_64_copy", "xxh3_64_copy of again"], lines
    assert all("/ copy only" in line for line in lines[1:-1])


def test_bench_fill_counts_both_threads_of_a_fresh_first_epoch(tmp_path):
    """bench.fill runs one fill per fresh process and reports the committer's share: its commits, CPU and faults."""
    from bench import fill

    result = fill.main(["--workload", "dict", "--n", "6", "--reps", "1", "--data", str(tmp_path)])
    (row,) = result["rows"]
    assert row["commits"] >= 1 and row["committer_cpu_us"] > 0 and row["main_cpu_us"] > 0
    assert row["bare_us"] > 0 and row["fill_us"] > 0 and row["ratio"] == pytest.approx(row["bare_us"] / row["fill_us"])
    assert row["main_faults"] >= 0 and row["committer_faults"] >= 0
