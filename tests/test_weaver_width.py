"""The Weaver width sweep: its grid, and its rows against the acceptance benchmark (default width) and against
SpeculativeDecoder decoding with the wider step."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.runtime import acceptance, weaver_width
from tfm_runtime.acceptance import StaticWalkTrees, build_trees, continuations, trajectory, walk
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.worlds import tiny_world


def test_grid_keeps_one_row_per_width():
    assert weaver_width.widths([8, 64], [16, 8, 4]) == [(8, 16, 1), (8, 4, 2), (64, 16, 4), (64, 8, 8), (64, 4, 16)]


def test_default_width_rows_equal_the_acceptance_bench(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    prompts = [f"question {i}: tell me more." for i in range(3)]
    with open(d / "mtbench.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    common = ["--world", "tiny", "--prompts-dir", str(d), "--datasets", "mtbench", "--limit", "3", "--budgets", "8",
              "--max-new-tokens", "12", "--no-progress", "--dtype", "float32"]
    out = tmp_path / "width.json"
    weaver_width.main(common + ["--steps", "16", "2", "--out", str(out)])
    rows = {r["width"]: r for r in json.load(open(out))["rows"]}
    assert sorted(rows) == [1, 4] and all(r["prompts"] == 3 for r in rows.values())

    bench = tmp_path / "acceptance.json"
    acceptance.main(common + ["--no-t1", "--check-prompts", "0", "--out", str(bench)])
    [ref] = [r for r in json.load(open(bench))["rows"] if r["proposal"] == "weaver"]
    for k in ("acceptance_length", "verify_steps", "new_tokens", "accept_rate_by_depth"):
        assert rows[1][k] == ref[k], k                          # steps 16 at budget 8: the default width 1


def test_t1_rows_with_more_children_per_node(tmp_path):
    """--temperature 1: the default shape's row equals the acceptance bench's T = 1 Weaver row (the same samples);
    each --expands value gives its row."""
    d = tmp_path / "prompts"
    d.mkdir()
    with open(d / "mtbench.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"question {i}: tell me more."}) + "\n" for i in range(3))
    common = ["--world", "tiny", "--prompts-dir", str(d), "--datasets", "mtbench", "--limit", "3", "--budgets", "16",
              "--max-new-tokens", "12", "--no-progress", "--dtype", "float32"]
    out = tmp_path / "width.json"
    weaver_width.main(common + ["--steps", "16", "--temperature", "1", "--expands", "8", "2", "--out", str(out)])
    res = json.load(open(out))
    rows = {r["expand"]: r for r in res["rows"]}
    assert res["temperature"] == 1.0 and sorted(rows) == [2, 8] and {r["temperature"] for r in rows.values()} == {1.0}
    assert "| 16 | 1 | 2 |" in weaver_width.table(res)
    bench = tmp_path / "acceptance.json"
    acceptance.main(common + ["--check-prompts", "0", "--t1-prompts", "0", "--out", str(bench)])
    [ref] = [r for r in json.load(open(bench))["rows"] if r["proposal"] == "weaver" and r["temperature"] == 1.0]
    for k in ("acceptance_length", "verify_steps", "new_tokens", "accept_rate_by_depth"):
        assert rows[8][k] == ref[k], k


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_wider_steps_walk_as_the_decoder_decodes(family):
    """At each width the walk along the greedy continuation (reference and shape-static trees) gives the decoder's
    per-step acceptance and tree sizes; the widths build different trees. A 12-token vocabulary makes the random
    tiny drafter accepted often, its marginals made peaked so that scores order nodes across depths."""
    w = tiny_world(family, dtype=torch.float64, vocab_size=12, candidate_pool=8)
    with torch.no_grad():
        w.drafter.norm.weight.mul_(8.0)                     # peaked DFlash marginals: best-first goes deep
    prompts, n, L = [[3, 5, 7], [9, 4, 4, 8, 1, 2, 6], [11]], 24, w.drafter.cfg.block_size - 1
    trajs = [trajectory(w.target, w.drafter, p, n, c) for p, c in zip(prompts, continuations(w.target, prompts, n + L))]
    by_width = {}
    for width in (1, 3, 6):
        dec = SpeculativeDecoder(w.target, w.drafter, w.weaver, tree_budget=12, proposal="weaver", width=width)
        static = StaticWalkTrees(dec, batch=len(prompts), K=8, L=L)
        walked = walk(dec, trajs, n, eos_token_id=None)
        assert walk(dec, trajs, n, eos_token_id=None, static=static) == walked, width
        for p, (accepted, sizes) in zip(prompts, walked):
            out = dec.generate(p, max_new_tokens=n, temperature=0.0)
            assert (out.stats.accept_lengths, out.stats.tree_sizes) == (accepted, sizes), width
        trees = build_trees(dec, trajs, [0] * len(trajs))
        by_width[width] = [(t.tokens.tolist(), t.parents.tolist()) for t in trees]
        assert any(a > 1 for accepted, _ in walked for a in accepted)
    assert by_width[1] != by_width[6], "the width must change the trees"
