"""The acceptance benchmark's command line: prompt sets from a folder, results written after each dataset, and a
resumed run that keeps the finished datasets and runs the rest."""
from __future__ import annotations

import json

import pytest

from benchmarks.runtime import acceptance

ARGS = ["--world", "tiny", "--limit", "2", "--budgets", "8", "--max-new-tokens", "8", "--check-prompts", "1",
        "--t1-prompts", "0", "--no-progress"]


@pytest.fixture
def prompts_dir(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    for name in ("mtbench", "humaneval", "sharegpt_heldout"):
        with open(d / f"{name}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"prompt": f"{name} question {i}: tell me more."}) + "\n")
    return str(d)


def test_a_resumed_run_keeps_finished_datasets_and_runs_the_rest(prompts_dir, tmp_path, capsys):
    out = str(tmp_path / "acceptance.json")
    acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "--out", out])
    first = json.load(open(out))
    assert first["env"]["command"] and sorted(first["candidate_hit_rate_by_depth"]) == ["mtbench"]
    assert first["crosscheck_t0"]["mtbench"]["identical"] == first["crosscheck_t0"]["mtbench"]["requests_x_configs"]
    mt = [r for r in first["rows"] if r["dataset"] == "mtbench"]
    assert {(r["proposal"], r["budget"]) for r in mt} == {("chain", 7), ("ddtree", 8), ("weaver", 8)}
    assert all(r["prompts"] == 2 for r in mt)

    first["rows"][0]["acceptance_length"] = 99.0              # a kept row is taken as written, not recomputed
    with open(out, "w") as f:
        json.dump(first, f)
    acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "sharegpt", "--out", out,
                            "--resume"])
    second = json.load(open(out))
    assert sorted(second["candidate_hit_rate_by_depth"]) == ["mtbench", "sharegpt"]
    assert second["rows"][:len(mt)] == first["rows"][:len(mt)] and second["rows"][0]["acceptance_length"] == 99.0
    assert {r["dataset"] for r in second["rows"][len(mt):]} == {"sharegpt"}
    assert "| sharegpt | 0 |" in capsys.readouterr().out


def test_bad_resumes_are_refused(prompts_dir, tmp_path):
    with pytest.raises(SystemExit):
        acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--resume"])        # no --out
    out = tmp_path / "a.json"
    out.write_text(json.dumps({"env": {}, "max_new_tokens": 256, "rows": []}))
    with pytest.raises(SystemExit):
        acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--out", str(out), "--resume"])
    assert json.loads(out.read_text())["max_new_tokens"] == 256                   # left as it was
