"""The acceptance benchmark's command line: prompt sets from a folder, results written after each dataset, and a
resumed run that keeps the finished datasets and runs the rest."""
from __future__ import annotations

import json

import pytest

from benchmarks.runtime import acceptance

ARGS = ["--world", "tiny", "--limit", "2", "--budgets", "8", "--max-new-tokens", "8", "--t1-prompts", "0",
        "--no-progress"]


@pytest.fixture
def prompts_dir(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    for name in ("mtbench", "humaneval", "sharegpt_heldout"):
        with open(d / f"{name}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"prompt": f"{name} question {i}: tell me more."}) + "\n")
    return str(d)


def test_a_resumed_run_keeps_finished_phases_and_runs_the_rest(prompts_dir, tmp_path, capsys):
    out = str(tmp_path / "acceptance.json")
    acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "--check-prompts", "0",
                            "--out", out])
    first = json.load(open(out))
    assert first["env"]["command"] and sorted(first["candidate_hit_rate_by_depth"]) == ["mtbench"]
    assert first["finished"] == [["t0", "mtbench"]] and first["crosscheck_t0"] == {}
    mt = [r for r in first["rows"] if r["dataset"] == "mtbench"]
    assert {(r["proposal"], r["budget"]) for r in mt} == {("chain", 7), ("ddtree", 8), ("weaver", 8)}
    assert all(r["prompts"] == 2 for r in mt)

    first["rows"][0]["acceptance_length"] = 99.0              # a kept row is taken as written, not recomputed
    with open(out, "w") as f:
        json.dump(first, f)
    acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "sharegpt", "--check-prompts", "1",
                            "--tree-builder", "static", "--out", out, "--resume"])
    second = json.load(open(out))
    assert sorted(second["candidate_hit_rate_by_depth"]) == ["mtbench", "sharegpt"]
    assert [tuple(f) for f in second["finished"]] == [("t0", "mtbench"), ("t0", "sharegpt"), ("check", "mtbench"),
                                                      ("check", "sharegpt")]
    assert all(c == {"requests_x_configs": 3, "identical": 3} for c in second["crosscheck_t0"].values())
    assert second["earlier_runs"] == [first["env"]]
    assert second["rows"][:len(mt)] == first["rows"][:len(mt)] and second["rows"][0]["acceptance_length"] == 99.0
    assert {r["dataset"] for r in second["rows"][len(mt):]} == {"sharegpt"}
    assert "| sharegpt | 0 |" in capsys.readouterr().out

    acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "--check-prompts", "1",
                            "--t1-prompts", "1", "--out", out, "--resume"])              # only T = 1 is left to run
    third = json.load(open(out))
    assert third["rows"][:len(second["rows"])] == second["rows"] and third["finished"][-1] == ["t1", "mtbench"]
    t1 = [(r["proposal"], r["verification"], r["prompts"]) for r in third["rows"][len(second["rows"]):]]
    assert t1 == [("chain", "target_only", 1), ("ddtree", "target_only", 1), ("weaver", "target_only", 1),
                  ("weaver", "traversal", 1)]


def test_bad_resumes_are_refused(prompts_dir, tmp_path):
    with pytest.raises(SystemExit):
        acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--resume"])        # no --out
    out = tmp_path / "a.json"
    out.write_text(json.dumps({"env": {}, "max_new_tokens": 256, "rows": []}))
    with pytest.raises(SystemExit):
        acceptance.main(ARGS + ["--prompts-dir", prompts_dir, "--out", str(out), "--resume"])
    assert json.loads(out.read_text())["max_new_tokens"] == 256                   # left as it was


def test_adapter_labels_tell_adapters_apart():
    names = acceptance.short_names(["runs/demo/artifacts/weaver", "assets/smollm2-135m-instruct/weaver",
                                    "demo/smollm2-135m-weaver"])
    assert names == {"runs/demo/artifacts/weaver": "artifacts/weaver",
                     "assets/smollm2-135m-instruct/weaver": "smollm2-135m-instruct/weaver",
                     "demo/smollm2-135m-weaver": "smollm2-135m-weaver"}
    assert acceptance.short_names(["a/w", "b/a/w"]) == {"a/w": "a/w", "b/a/w": "b/a/w"}   # one a suffix of the other
    assert acceptance.short_names(["org/w"]) == {"org/w": "w"}
    table = acceptance.table({"rows": [
        {"dataset": "d", "temperature": 0.0, "proposal": "weaver", "budget": 16, "adapter": a, "verification": "greedy",
         "acceptance_length": x} for a, x in (("x/weaver", 2.0), ("y/weaver", 3.0))]})
    assert "[x/weaver]" in table and "[y/weaver]" in table


def test_t1_rows_of_the_fast_decoder_equal_the_reference_decoders(prompts_dir, tmp_path):
    """The same sampled decodes (same generators) through FastDecoder and SpeculativeDecoder: the same rows."""
    rows = {}
    for dec in ("reference", "fast"):
        out = str(tmp_path / f"{dec}.json")
        acceptance.main(ARGS[:-3] + ["--t1-prompts", "2", "--max-new-tokens", "12", "--prompts-dir", prompts_dir,
                                     "--datasets", "mtbench", "--check-prompts", "0", "--t1-decoder", dec,
                                     "--no-progress", "--out", out])
        rows[dec] = [r for r in json.load(open(out))["rows"] if r["temperature"] == 1.0]
    assert {r["method"] for r in rows["fast"]} == {"fast_decoder"} and len(rows["fast"]) == 4
    strip = lambda rs: [{k: v for k, v in r.items() if k != "method"} for r in rs]  # noqa: E731
    assert strip(rows["fast"]) == strip(rows["reference"])
