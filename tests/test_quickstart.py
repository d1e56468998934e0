"""The README's quickstart, command for command: collect on the tiny world, train a Weaver, decode with it."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_quickstart_collect_train_load_and_decode(tmp_path):
    shards, run = str(tmp_path / "shards"), str(tmp_path / "run")
    r = _run("pipelines.collect", "--config", "configs/collect_tiny.yaml", "--output-dir", shards, "--no-ray",
             "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run("pipelines.train", "--config", "configs/train_tiny.yaml", "--data", shards, "--output-dir", run,
             "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    final = os.path.join(run, "final")
    assert sorted(os.listdir(final)) == ["config.json", "contract.json", "model.safetensors"]
    with open(os.path.join(final, "contract.json")) as f:
        assert json.load(f)["target_id"] == "tiny:llama:0"                   # loadable by its spec
    r = _run("tfm_runtime.decode", "--adapter", final, "--prompt", "Explain recursion.", "--prompt",
             "Name three rivers.", "--max-new-tokens", "24", "--check")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stats = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(stats) == 2 and all(s["new_tokens"] == 24 and s["acceptance_length"] >= 1 for s in stats)
    assert r.stdout.count("lossless: identical to the target decoding alone") == 2
