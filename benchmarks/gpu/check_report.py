"""The results file of `check.sh`: the GPU test summary and each headline figure beside its committed value.

    python -m benchmarks.gpu.check_report OUT_DIR [--out benchmarks/results/gpu_check_h200.json]

OUT_DIR holds what check.sh wrote (gpu_tests.log, gdn.json, train.json, rollout.json). Committed values come from
benchmarks/results/: gdn_tree_h200.json (`summary`: verify_us per tree and n), train_h200.json (the first run at
1024 rows), rollout_h200.json (our rows without EOS). Prints the table; `within_5pct` says whether every figure is.
"""
from __future__ import annotations

import argparse
import json
import os
import re

from benchmarks.common import env, write_results

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def gdn_rows(now: dict | None, committed: dict) -> list[dict]:
    rows = []
    for tree in ("chain", "eagle"):
        for n in (65, 129):
            want = [r["verify_us"] for r in committed["summary"] if r["tree"] == tree and r["n"] == n]
            got = [r["verify_us"] for r in (now or {}).get("summary", []) if r["tree"] == tree and r["n"] == n]
            rows.append(row(f"GDN tree verify, {tree} tree, n = {n} (us)", want[0] if want else None,
                            got[0] if got else None, "gdn_tree_h200.json"))
    return rows


def row(figure: str, committed, now, file: str) -> dict:
    change = round(100 * (now - committed) / committed, 2) if committed and now is not None else None
    return {"figure": figure, "committed": committed, "now": None if now is None else round(now, 2), "file": file,
            "change_pct": change}


def tests_summary(log: str) -> dict:
    """pytest's last line and FAILED lines -> counts and the failed tests."""
    try:
        with open(log) as f:
            text = f.read()
    except OSError:
        return {"passed": None, "failed": None, "skipped": None, "failed_tests": [], "note": "no log"}
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1]
                                                  if text.strip() else "")}
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
            + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
            "failed_tests": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="check.sh's OUT folder")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_check_h200.json"))
    ap.add_argument("--description", default="The GPU tests of every kernel, the engine, the fast backend, the Weaver "
                                             "and the rollout, and the headline figures measured once, against the "
                                             "committed ones (benchmarks/gpu/check.sh).")
    args = ap.parse_args(argv)
    gdn, train, rollout = (load(os.path.join(args.dir, f)) for f in ("gdn.json", "train.json", "rollout.json"))
    rows = gdn_rows(gdn, load(os.path.join(RESULTS, "gdn_tree_h200.json")))
    committed_train = load(os.path.join(RESULTS, "train_h200.json"))["session11"]["runs"][0]["step_ms"]
    rows.append(row("Weaver training step, qwen36_27b preset, 1024 rows (ms)", committed_train,
                    train["median_step_s"] * 1e3 if train else None, "train_h200.json"))
    committed_rollout = load(os.path.join(RESULTS, "rollout_h200.json"))["rows"]
    for batch in (256, 1024):
        want = [r["tokens_per_s"] for r in committed_rollout if r["engine"] == "ours" and r["batch"] == batch
                and r["eos"] == "ignored"]
        got = [r["tokens_per_s"] for r in (rollout or {}).get("rows", []) if r["engine"] == "ours"
               and r["batch"] == batch and r["eos"] == "ignored"]
        rows.append(row(f"rollout, b = {batch}, eos ignored (new tokens/s)", round(want[0]) if want else None,
                        got[0] if got else None, "rollout_h200.json"))
    measured = [r for r in rows if r["change_pct"] is not None]
    run_env = dict((gdn or train or rollout or {}).get("env") or env())       # the device run's, not this machine's
    run_env["command"] = "OUT=out bash benchmarks/gpu/check.sh"
    result = {"env": run_env, "description": args.description,
              "gpu_tests": tests_summary(os.path.join(args.dir, "gpu_tests.log")), "rows": rows,
              "within_5pct": bool(measured) and len(measured) == len(rows)
              and all(abs(r["change_pct"]) <= 5 for r in measured)}
    write_results(args.out, result)
    t = result["gpu_tests"]
    print(f"GPU tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped")
    for r in rows:
        print(f"{r['figure']:<58}{r['committed']!s:>10}{r['now']!s:>10}{r['change_pct']!s:>8} %")
    print(f"every figure within 5%: {result['within_5pct']}")
    return result


if __name__ == "__main__":
    main()
