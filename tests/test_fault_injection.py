"""A short version of benchmarks/pipelines/fault_injection.py: collect and train each killed (SIGKILL) twice, once at
a random time and once in the middle of a write, then resumed to outputs identical to an uninterrupted run's with
no partial file left."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_killed_and_resumed_runs_equal_uninterrupted_ones(tmp_path):
    out = str(tmp_path / "faults.json")
    r = subprocess.run([sys.executable, "-m", "benchmarks.pipelines.fault_injection", "--kills", "2", "--seed", "1",
                        "--out", out], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out) as f:
        results = json.load(f)
    assert list(results)[0] == "env" and results["env"]["gpu"] is None
    for stage in ("collect", "train"):
        t = results["totals"][stage]
        assert t["targeted_writes"] == 1 and t["killed_runs"] >= 1      # a timed kill can come after a fast run's end
        assert (t["resumed_ok"], t["identical"], t["with_partial_files_left"]) == (2, 2, 0), results["rows"]
