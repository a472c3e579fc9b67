#!/usr/bin/env bash
# Instructions per sample of the loader's hot loop, native vs pure Python, counted by valgrind's callgrind
# (timings on a shared 2-core machine are too noisy to compare small differences).
#
#   bench/callgrind_native.sh [N]        N samples of 3x32x32 (default 4000)
#
# Each path runs twice, with 1 and 3 epochs; (instructions(3) - instructions(1)) / (2 N) is the cost of one
# sample's read, with the process's start, imports and cache fill cancelled out. One copy thread (--threads 1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
N=${1:-4000}
out=$(mktemp -d)
"$PY" -m bench.native --callgrind-child native "$N" 0  # fill the cache outside valgrind
count() {  # path epochs -> total instructions
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2" "$PY" -m bench.native --callgrind-child "$1" "$N" "$2" \
        >/dev/null 2>"$out/log.$1.$2"
    grep -E "^summary:|^totals:" "$out/cg.$1.$2" | head -1 | awk '{print $2}'
}
for path in native python; do
    one=$(count "$path" 1)
    three=$(count "$path" 3)
    echo "$path: $(( (three - one) / (2 * N) )) instructions per sample (epochs 1: $one, 3: $three)"
done
rm -rf "$out"
