#!/usr/bin/env bash
# Old against new: the native forward's case times (scripts/native_case_times.py) from two
# checkouts' src folders, alternating processes ROUNDS times.  Per case it prints the best
# time of each side and the median over rounds of the paired ratio new/old (each round's two
# processes run back to back: on a machine whose speed drifts by a tenth between processes,
# that median is the stable figure).  Each checkout builds (or finds) its own extension by its
# sources' hash in TORCH_EXTENSIONS_DIR.  Pin to one core on a shared machine: CORES=0.
# OLDENV / NEWENV: environment settings for one side (e.g. NEWENV=ATTNLAB_NATIVE_LOCAL=0).
# SCRIPT: another script in scripts/ printing `name=ms ...` on one line, called with REPS
# (SCRIPT=cold_call_times.py: each case hot and cold).
#
#   CASES=w256,doc8 DT=bfloat16 NT=2 scripts/ab_native.sh OLD/src NEW/src [ROUNDS] [REPS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3} reps=${4:-7} cores=${CORES:-0-$(($(nproc) - 1))}
py=${PYTHON:-.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "$rounds"); do
  for side in old new; do
    src=$old envs=${OLDENV:-}
    [ "$side" = new ] && src=$new envs=${NEWENV:-}
    # shellcheck disable=SC2086  # envs: words of NAME=value
    echo "$r $side $(env $envs PYTHONPATH=$src taskset -c "$cores" "$py" "$here/${SCRIPT:-native_case_times.py}" "$reps")"
  done
done | python3 -c "
import collections, statistics, sys
t = collections.defaultdict(dict)
for line in sys.stdin:
    r, side, *kv = line.split()
    for x in kv:
        n, v = x.split('=')
        t[(n, r)][side] = float(v)
for n in sorted({n for n, _ in t}):
    pairs = [d for (m, _), d in t.items() if m == n and len(d) == 2]
    o, w = min(d['old'] for d in pairs), min(d['new'] for d in pairs)
    ratios = [d['new'] / d['old'] for d in pairs]
    print(f'{n:8s} old {o:8.3f} ms  new {w:8.3f} ms  best new/old {w / o:.3f}  median paired new/old '
          f'{statistics.median(ratios):.3f} (' + ' '.join(f'{x:.2f}' for x in ratios) + ')')
"
