"""benchmarks.gpu.check_report: GPU test counts from pytest's log and each headline figure against the committed one."""
import json

from benchmarks.gpu import check_report


def test_report_compares_each_figure_and_flags_a_change_over_5pct(tmp_path):
    committed = json.load(open(f"{check_report.RESULTS}/gdn_tree_h200.json"))["summary"]
    (tmp_path / "gdn.json").write_text(json.dumps({"env": {"git_revision": "abc"}, "summary": [
        dict(r, verify_us=r["verify_us"] * (1.10 if (r["tree"], r["n"]) == ("eagle", 129) else 1.01))
        for r in committed]}))
    (tmp_path / "train.json").write_text(json.dumps({"median_step_s": 0.0335}))
    (tmp_path / "gpu_tests.log").write_text("..F\nFAILED tests/test_x.py::test_y - boom\n"
                                            "1 failed, 219 passed, 64 skipped in 150.2s\n")
    out = tmp_path / "report.json"
    r = check_report.main([str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text())["env"] == {"git_revision": "abc", "command": "OUT=out bash benchmarks/gpu/check.sh"}
    assert r["gpu_tests"] == {"passed": 219, "failed": 1, "skipped": 64, "failed_tests": ["tests/test_x.py::test_y"]}
    by = {row["figure"]: row for row in r["rows"]}
    assert by["GDN tree verify, chain tree, n = 65 (us)"]["change_pct"] == 1.0
    assert by["GDN tree verify, eagle tree, n = 129 (us)"]["change_pct"] == 10.0
    assert by["rollout, b = 256, eos ignored (new tokens/s)"]["now"] is None      # no rollout.json: not measured
    assert r["within_5pct"] is False
