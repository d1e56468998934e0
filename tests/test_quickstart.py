"""The README's quickstart, command for command: collect on the tiny world, train a Weaver, decode with it. Each
`python -m ...` command runs as `__main__` in the test's interpreter (the run_here fixture), from the repository
root as the README does."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_collect_train_load_and_decode(tmp_path, run_here, monkeypatch):
    monkeypatch.chdir(ROOT)
    shards, run = str(tmp_path / "shards"), str(tmp_path / "run")
    code, _, err = run_here("pipelines.collect", "--config", "configs/collect_tiny.yaml", "--output-dir", shards,
                            "--no-ray", "--no-progress")
    assert code == 0, err[-3000:]
    code, _, err = run_here("pipelines.train", "--config", "configs/train_tiny.yaml", "--data", shards,
                            "--output-dir", run, "--no-progress")
    assert code == 0, err[-3000:]
    final = os.path.join(run, "final")
    assert sorted(os.listdir(final)) == ["config.json", "contract.json", "model.safetensors"]
    with open(os.path.join(final, "contract.json")) as f:
        assert json.load(f)["target_id"] == "tiny:llama:0"                   # loadable by its spec
    code, out, err = run_here("tfm_runtime.decode", "--adapter", final, "--prompt", "Explain recursion.", "--prompt",
                              "Name three rivers.", "--max-new-tokens", "24", "--check")
    assert code == 0, out[-3000:] + err[-3000:]
    stats = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(stats) == 2 and all(s["new_tokens"] == 24 and s["acceptance_length"] >= 1 for s in stats)
    assert out.count("lossless: identical to the target decoding alone") == 2
