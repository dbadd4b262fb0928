#!/usr/bin/env bash
# Old against new: the native forward's case times (scripts/native_case_times.py) from two
# checkouts' src folders, alternating processes ROUNDS times, the best of each printed with
# the ratio.  Each checkout builds (or finds) its own extension by its sources' hash in
# TORCH_EXTENSIONS_DIR.  Pin to one core on a shared machine: CORES=0.
#
#   CASES=w256,doc8 DT=bfloat16 CORES=0 scripts/ab_native.sh OLD/src NEW/src [ROUNDS] [REPS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3} reps=${4:-7} cores=${CORES:-0-$(($(nproc) - 1))}
py=${PYTHON:-.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
for _ in $(seq "$rounds"); do
  for side in old new; do
    src=$old
    [ "$side" = new ] && src=$new
    echo "$side $(PYTHONPATH=$src taskset -c "$cores" "$py" "$here/native_case_times.py" "$reps")"
  done
done | python3 -c "
import collections, sys
best = collections.defaultdict(lambda: float('inf'))
for line in sys.stdin:
    side, *kv = line.split()
    for x in kv:
        n, t = x.split('=')
        best[(side, n)] = min(best[(side, n)], float(t))
for n in sorted({n for _, n in best}):
    o, w = best[('old', n)], best[('new', n)]
    print(f'{n:8s} old {o:8.3f} ms  new {w:8.3f} ms  new/old {w / o:.3f}')
"
