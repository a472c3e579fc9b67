"""One system in a fresh process: ``loader`` (DataLoader rates and memory) or ``fresh`` (reuse).

    python -m bench.child loader|fresh SYSTEM WORKLOAD N DATA ROOT REPS

Prints one JSON object. Run by bench.run; each call is its own process so memory and
"fresh process" figures belong to that system alone.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler

from .systems import BY_NAME
from .workloads import Workload

BATCH = 64


class WarmThenShuffle(Sampler):
    """Batches for a DataLoader with 2 persistent workers.

    In warm-up mode every batch is yielded twice in a row; the DataLoader hands batches to
    its workers round-robin, so each worker reads every index once (a per-worker cache is
    then full, as after many epochs). Afterwards: a shuffled epoch of ordinary batches.
    """

    def __init__(self, n: int, workers: int) -> None:
        self.n, self.workers, self.warmup, self.epoch = n, workers, True, 0

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.epoch).shuffle(order)
        self.epoch += 1
        for start in range(0, self.n, BATCH):
            batch = order[start : start + BATCH]
            for _ in range(self.workers if self.warmup else 1):
                yield batch

    def __len__(self) -> int:
        batches = -(-self.n // BATCH)
        return batches * (self.workers if self.warmup else 1)


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process (shared pages divided among the processes sharing them)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def _children() -> dict[int, list[tuple[int, str]]]:
    """Parent pid -> [(pid, name)] for every process, from /proc."""
    tree: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append((int(entry), name))
    return tree


def process_tree_pss() -> dict[str, int]:
    """PSS of this process and all its descendants (workers, a manager process, ...)."""
    tree = _children()
    out = {f"main:{os.getpid()}": pss_bytes(os.getpid())}
    todo = list(tree.get(os.getpid(), []))
    while todo:
        pid, name = todo.pop()
        try:
            out[f"{name}:{pid}"] = pss_bytes(pid)
        except OSError:
            continue
        todo += tree.get(pid, [])
    return out


def collate_dict(batch: list[dict]) -> dict:
    """What a user writes for the dict workload: stacked features, padded tokens, a list of texts."""
    from torch.nn.utils.rnn import pad_sequence
    from torch.utils.data import default_collate

    tokens = [t for sample in batch for t in sample["tokens"]]
    return {
        "features": default_collate([sample["features"] for sample in batch]),  # stacked in shared memory
        "tokens": pad_sequence(tokens, batch_first=True),
        "lengths": torch.tensor([len(t) for t in tokens]),
        "text": [sample["text"] for sample in batch],
    }


def loader(system_name: str, workload: Workload, root: Path, reps: int) -> dict:
    system = BY_NAME[system_name]
    source = workload.source()
    ds = system.open(workload, source, root)
    sampler = WarmThenShuffle(workload.n, 2)
    dl = DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        collate_fn=None if workload.fixed_shape else collate_dict,
    )
    count = sum(1 for _ in dl)  # warm-up: every worker reads every index once
    assert count == len(sampler)
    sampler.warmup = False
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        seen = sum(len(b[1]) if workload.fixed_shape else len(b["text"]) for b in dl)
        rates.append(seen / (time.perf_counter() - start))
    memory = process_tree_pss()
    return {"rates": rates, "pss": sum(memory.values()), "pss_by_process": memory}


def fresh(system_name: str, workload: Workload, root: Path) -> dict:
    """A later run: open the existing cache, time the first sample, then one pass in random order."""
    system = BY_NAME[system_name]
    source = workload.source()
    order = list(range(workload.n))
    random.Random(os.getpid()).shuffle(order)
    start = time.perf_counter()
    ds = system.open(workload, source, root)
    ds[order[0]]
    first = time.perf_counter() - start
    start = time.perf_counter()
    for i in order:
        ds[i]
    rate = workload.n / (time.perf_counter() - start)
    system.close(ds)
    return {"first_sample_s": first, "rate": rate}


def main(argv: list[str]) -> None:
    mode, system_name, name, n, data, root, reps = argv
    torch.set_num_threads(1)
    workload = Workload(name, int(n), Path(data))
    if mode == "loader":
        result = loader(system_name, workload, Path(root), int(reps))
    else:
        result = fresh(system_name, workload, Path(root))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
