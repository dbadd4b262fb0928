"""Compare the JUnit results of run.sh: stock vs attnlab counts per model, and the tests
that fail (or error) only with attnlab, each with the first line of its message.

    python compare.py [--stock STOCK_DIR] RESULTS_DIR MODEL [MODEL ...]

The stock results are read from STOCK_DIR when given (e.g. a RESULTS folder holding only
attnlab runs of another source), else from RESULTS_DIR.  Counts are per test function
(JUnit test cases); pytest's own summary line also counts failed subtests.
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(path):
    """{test id: (outcome, message)} with outcome in passed/failed/error/skipped."""
    res = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                msg = (child.get("message") or "").strip().splitlines()[0:1]
                msg = msg[0][:200] if msg else ""
                if outcome != "skipped":
                    break  # a failure beats a teardown error's skipped sibling
        if tid in res and res[tid][0] in ("failed", "error"):
            continue  # keep a call failure over its teardown error
        res[tid] = (outcome, msg)
    return res


def main(results, models, stock=None):
    results = Path(results)
    stock = Path(stock) if stock else results
    print(f"{'model':8} {'mode':8} {'passed':>7} {'failed':>7} {'error':>6} {'skipped':>8}")
    bad = 0
    for m in models:
        got = {}
        for mode in ("stock", "attnlab"):
            p = (stock if mode == "stock" else results) / f"{m}-{mode}.xml"
            if not p.exists():
                continue
            got[mode] = outcomes(p)
            n = {k: 0 for k in ("passed", "failed", "error", "skipped")}
            for o, _ in got[mode].values():
                n[o] += 1
            print(f"{m:8} {mode:8} {n['passed']:7} {n['failed']:7} {n['error']:6} {n['skipped']:8}")
        if len(got) == 2:
            for tid, (o, msg) in sorted(got["attnlab"].items()):
                so = got["stock"].get(tid, ("absent", ""))[0]
                if o in ("failed", "error") and so not in ("failed", "error"):
                    bad += 1
                    print(f"  attnlab-only {o} (stock {so}): {tid}\n      {msg}")
            for tid, (o, _) in sorted(got["stock"].items()):
                if o in ("failed", "error") and got["attnlab"].get(tid, ("absent",))[0] not in ("failed", "error"):
                    print(f"  stock-only {o}: {tid}")
    print(f"tests failing only with attnlab: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    stock_dir = None
    if args[:1] == ["--stock"]:
        stock_dir, args = args[1], args[2:]
    sys.exit(main(args[0], args[1:], stock_dir))
