"""The acceptance benchmark's command line: prompt sets from a folder, results written after each dataset, and a
resumed run that keeps the finished datasets and runs the rest."""
from __future__ import annotations

import json

import pytest

from benchmarks.runtime import acceptance

BASE = ["--world", "tiny", "--limit", "2", "--budgets", "8", "--max-new-tokens", "8", "--no-progress"]
ARGS = BASE + ["--no-t1"]


@pytest.fixture
def prompts_dir(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    for name in ("mtbench", "humaneval", "sharegpt_heldout"):
        with open(d / f"{name}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"prompt": f"{name} question {i}: tell me more."}) + "\n")
    return str(d)


def stopped_run(argv, out, writes, monkeypatch) -> dict:
    """`acceptance.main(argv)` interrupted (KeyboardInterrupt) right after it writes its results for the `writes`-th
    time: the results file it leaves."""
    write, calls = acceptance.write_results, []

    def stop(path, result):
        write(path, result)
        calls.append(1)
        if len(calls) == writes:
            raise KeyboardInterrupt
    monkeypatch.setattr(acceptance, "write_results", stop)
    with pytest.raises(KeyboardInterrupt):
        acceptance.main(argv)
    monkeypatch.undo()
    with open(out) as f:
        return json.load(f)


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

    second["finished"].append(["t1", "mtbench"])              # a T = 1 phase of an earlier version: its decoded
    second["rows"].append({**second["rows"][0], "temperature": 1.0, "verification": "target_only",  # rows are
                           "method": "fast_decoder"})                                              # not kept
    with open(out, "w") as f:
        json.dump(second, f)
    acceptance.main(BASE + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "--check-prompts", "1",
                            "--t1-prompts", "1", "--out", out, "--resume"])              # only T = 1 is left to run
    third = json.load(open(out))
    assert third["rows"][:len(second["rows"]) - 1] == second["rows"][:-1]
    assert third["finished"][-3:] == [["t1_walk", "mtbench"], ["check_t1", "mtbench"], ["t1_traversal", "mtbench"]]
    assert ["t1", "mtbench"] not in third["finished"]
    new_rows = third["rows"][len(second["rows"]) - 1:]
    t1 = [(r["proposal"], r["verification"], r["method"], r["prompts"]) for r in new_rows]
    assert t1 == [("chain", "target_only", "trajectory", 2), ("ddtree", "target_only", "trajectory", 2),
                  ("weaver", "target_only", "trajectory", 2), ("weaver", "traversal", "decoder", 1)]
    assert third["crosscheck_t1"] == {"mtbench": {"requests_x_configs": 3, "identical": 3}}
    assert sorted(third["candidate_hit_rate_by_depth_t1"]) == ["mtbench"]


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
    """The same sampled decodes (same generators) through FastDecoder and SpeculativeDecoder: the same rows; the
    T = 1 walk agrees with either decoder's own output."""
    rows = {}
    for dec in ("reference", "fast"):
        out = str(tmp_path / f"{dec}.json")
        acceptance.main(BASE + ["--t1-prompts", "2", "--max-new-tokens", "12", "--prompts-dir", prompts_dir,
                                "--datasets", "mtbench", "--check-prompts", "1", "--t1-decoder", dec, "--out", out])
        result = json.load(open(out))
        assert result["crosscheck_t1"] == {"mtbench": {"requests_x_configs": 3, "identical": 3}}   # walk = decoder
        rows[dec] = [r for r in result["rows"] if r["verification"] == "traversal"]
    assert {r["method"] for r in rows["fast"]} == {"fast_decoder"} and len(rows["fast"]) == 1
    strip = lambda rs: [{k: v for k, v in r.items() if k != "method"} for r in rs]  # noqa: E731
    assert strip(rows["fast"]) == strip(rows["reference"])


def test_a_t1_phase_stopped_part_way_resumes_after_its_last_row(prompts_dir, tmp_path, monkeypatch):
    """Each decoded (traversal) T = 1 row is saved as it comes; a resumed run keeps those rows (and the hand-written
    notes) and runs the rest: the rows equal those of a run never stopped."""
    args = BASE + ["--t1-prompts", "1", "--prompts-dir", prompts_dir, "--datasets", "mtbench", "--check-prompts", "0",
                   "--budgets", "8", "12", "16"]
    whole = str(tmp_path / "whole.json")
    acceptance.main(args + ["--out", whole])
    out = str(tmp_path / "stopped.json")
    stopped = stopped_run(args + ["--out", out], out, 4, monkeypatch)    # t0 and T = 1 walks, two traversal rows
    assert stopped["finished"] == [["t0", "mtbench"], ["t1_walk", "mtbench"]] and len(stopped["t1_partial"]) == 2
    stopped["rows"][-1]["acceptance_length"] = 99.0           # a kept row is taken as written, not recomputed
    stopped["notes"] = {"why": "kept"}
    with open(out, "w") as f:
        json.dump(stopped, f)
    acceptance.main(args + ["--out", out, "--resume"])
    resumed, straight = json.load(open(out)), json.load(open(whole))
    assert resumed["finished"] == straight["finished"] and resumed["t1_partial"] == []
    assert resumed["notes"] == {"why": "kept"}
    assert len(resumed["rows"]) == len(straight["rows"])
    t1 = lambda d: [r for r in d["rows"] if r["verification"] == "traversal"]  # noqa: E731
    assert t1(resumed)[1]["acceptance_length"] == 99.0
    t1(resumed)[1]["acceptance_length"] = t1(straight)[1]["acceptance_length"]
    assert t1(resumed) == t1(straight)


def test_a_walk_phase_stopped_part_way_resumes_after_its_last_group(prompts_dir, tmp_path, monkeypatch):
    """A walk phase saves its tallies after each group of prompts; a resumed run continues after the last saved
    group and its rows equal those of a run never stopped. A saved part of other settings is not reused."""
    args = ARGS + ["--prompts-dir", prompts_dir, "--datasets", "mtbench", "--check-prompts", "0", "--limit", "3",
                   "--group", "1"]
    whole = str(tmp_path / "whole.json")
    acceptance.main(args + ["--out", whole])
    out = str(tmp_path / "stopped.json")
    stopped = stopped_run(args + ["--out", out], out, 2, monkeypatch)    # after two groups of one prompt
    part = stopped["walk_partial"]
    assert stopped["finished"] == [] and stopped["rows"] == [] and (part["phase"], part["next"]) == ("t0", 2)
    assert all(t["steps"] > 0 and len(t["per_request"]) == 2 for _, t in part["tallies"])

    acceptance.main(args + ["--out", out, "--resume"])
    resumed, straight = json.load(open(out)), json.load(open(whole))
    assert resumed["walk_partial"] is None and resumed["finished"] == straight["finished"] == [["t0", "mtbench"]]
    assert resumed["rows"] == straight["rows"]
    assert resumed["candidate_hit_rate_by_depth"] == straight["candidate_hit_rate_by_depth"]

    stopped["walk_partial"]["tallies"][0][1]["tokens"] = 10 ** 6   # a saved part of another group size: not used
    with open(out, "w") as f:
        json.dump(stopped, f)
    acceptance.main(args[:-1] + ["3", "--out", out, "--resume"])
    regrouped = json.load(open(out))
    assert [r["new_tokens"] for r in regrouped["rows"]] == [r["new_tokens"] for r in straight["rows"]]
