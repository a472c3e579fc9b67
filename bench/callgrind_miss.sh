#!/usr/bin/env bash
# Instructions per miss of a shuffled lazy fill through ds[i] (issue #24), whole process (main thread, committer,
# LMDB, torch), counted by valgrind's callgrind: timings on a shared 2-core machine are too noisy to compare.
#
#   bench/callgrind_miss.sh [KIB]        samples of KIB x 32 x 32 uint8 and an int label (default 3)
#
# Two fills of the same 8000-sample source, of 2000 and of 8000 shuffled indices, flush included;
# (instructions(8000) - instructions(2000)) / 6000 is one miss, with the process's start, imports, the
# source's creation and a warm-up fill cancelled out (the source's own ds[i] work stays in). commit_interval
# is pinned to an hour so commits come by size, as at full speed (under valgrind a 1 s interval would cut
# commits by time, and the count would follow the machine's load).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
KIB=${1:-3}
out=$(mktemp -d)
child='
import os, random, shutil, sys, tempfile
import torch  # noqa: F401
from bench.workloads import ArrayDataset, tensor_data
import lmdbcache
n, kib, N = int(sys.argv[1]), int(sys.argv[2]), 8000
source = ArrayDataset(tensor_data(N, (kib, 32, 32)))
order = random.Random(0).sample(range(N), N)[:n]
tmp = tempfile.mkdtemp()
warm = lmdbcache.CachedDataset(ArrayDataset(tensor_data(64, (kib, 32, 32))), os.path.join(tmp, "w"), spot_check=0)
for i in range(64):
    warm[i]
warm.flush(); warm.close()
for i in range(N):
    source[i]
ds = lmdbcache.CachedDataset(source, os.path.join(tmp, "c"), spot_check=0, commit_interval=3600.0)
for i in order:
    ds[i]
ds.flush(); ds.close(); shutil.rmtree(tmp)
'
count() {  # misses -> total instructions
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1" "$PY" -c "$child" "$1" "$KIB" >/dev/null 2>"$out/log.$1"
    grep -E "^summary:|^totals:" "$out/cg.$1" | head -1 | awk '{print $2}'
}
a=$(count 2000)
b=$(count 8000)
echo "$KIB KiB: $(( (b - a) / 6000 )) instructions per miss (2000 misses: $a, 8000: $b); profiles in $out"
