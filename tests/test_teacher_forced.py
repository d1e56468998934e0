"""benchmarks/runtime/teacher_forced.py: the per-depth statistics on hand-made inputs, and the command on the tiny
world (rows per dataset and temperature, rates within [0, 1], a results file)."""
import json
import math

import torch

from benchmarks.runtime import teacher_forced


def test_depth_stats_count_hits_ranks_and_log_probs():
    # 2 positions, 2 depths, 3 candidates; the target's tokens: 7 then 9 (position 0), 5 then 1 (position 1)
    truth = torch.tensor([[7, 9], [5, 1]])
    cand = torch.tensor([[[7, 8, 6], [3, 9, 4]], [[2, 3, 5], [6, 8, 2]]])            # position 1 depth 2: a miss
    dflash = torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], [[0.5, 0.3, 0.2], [0.4, 0.3, 0.3]]]).log()
    weaver = torch.tensor([[[0.2, 0.7, 0.1], [0.1, 0.8, 0.1]], [[0.1, 0.1, 0.8], [0.4, 0.3, 0.3]]]).log()
    s = teacher_forced.DepthStats(2)
    s.add(truth, cand, dflash, weaver)
    r = s.row()
    assert r["positions"] == 2 and r["hit_rate"] == [1.0, 0.5]
    assert r["dflash_top1"] == [0.5, 0.0] and r["weaver_top1"] == [0.5, 0.5]     # ranks: DFlash 1 and 3; Weaver 2, 1
    assert r["dflash_top4"] == r["weaver_top4"] == [1.0, 0.5]
    assert r["dflash_logp_when_hit"][0] == round((math.log(0.5) + math.log(0.2)) / 2, 4)
    assert r["weaver_logp_when_hit"][1] == round(math.log(0.8), 4)


def test_tiny_world_command(tmp_path):
    out = tmp_path / "tf.json"
    assert teacher_forced.main(["--world", "tiny", "--limit", "2", "--max-new-tokens", "6", "--no-progress",
                                "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["env"]["command"] and [(r["dataset"], r["temperature"]) for r in res["rows"]] == [
        ("mtbench", 0.0), ("mtbench", 1.0)]
    for r in res["rows"]:
        assert r["prompts"] == 2 and r["positions"] == 12
        assert all(0 <= x <= 1 for k in ("hit_rate", "dflash_top1", "weaver_top4") for x in r[k])
        assert all(a <= b for a, b in zip(r["weaver_top1"], r["weaver_top4"]))
