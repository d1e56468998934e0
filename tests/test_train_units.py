"""Unit tests of the trainer's parts, in process: loss, evaluation, data order and split, config."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pipelines.train.config import TrainConfig
from pipelines.train.data import BatchOrder
from pipelines.train.evaluate import chain_acceptance, ddtree_from_candidates, tree_acceptance, truth_lengths
from pipelines.train.weaver_task import WeaverObjective, depth_weights, initial_weaver, weaver_loss
from tfm_runtime.models.weaver import WeaverConfig
from tfm_runtime.tree import Tree


def _kl_reference(logq, cand_ids, topk_ids, topk_lp, mask):
    """Loops in float64: pbar over the candidates found in the target's top-k, renormalised."""
    B, L, K = cand_ids.shape
    num, den = 0.0, 0.0
    for b in range(B):
        for d in range(L):
            p = np.zeros(K)
            for j, t in enumerate(topk_ids[b, d].tolist()):
                for c in range(K):
                    if cand_ids[b, d, c] == t:
                        p[c] += float(np.exp(topk_lp[b, d, j].item()))
            if not mask[b, d] or p.sum() == 0:
                continue
            p /= p.sum()
            nz = p > 0
            num += float((p[nz] * (np.log(p[nz]) - logq[b, d].double().numpy()[nz])).sum())
            den += 1
    return num / den


def test_kl_loss_equals_a_float64_loop_and_skips_depths_without_overlap():
    g = torch.Generator().manual_seed(0)
    B, L, K, k, V = 3, 4, 6, 5, 20
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * L)]).view(B, L, K)
    topk = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B * L)]).view(B, L, k)
    topk[0, 1] = torch.tensor([V - 1, V - 2, V - 3, V - 4, V - 5])
    cand[0, 1] = torch.arange(K)                                       # no overlap: no loss at (0, 1)
    lp = torch.log_softmax(torch.randn(B, L, k, generator=g), -1)
    logq = torch.log_softmax(torch.randn(B, L, K, generator=g, dtype=torch.float64), -1)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[2, 3] = False
    loss, valid = weaver_loss(logq, cand, torch.zeros(B, L, dtype=torch.long), mask, topk, lp, kind="kl",
                              weights=torch.ones(L))
    assert not valid[0, 1] and not valid[2, 3]
    assert float(loss) == pytest.approx(_kl_reference(logq, cand, topk, lp, mask), abs=1e-12)
    # gradient flows to log q only, and the KL is >= 0 with equality at q = pbar
    assert float(loss) > 0


def test_ce_loss_and_depth_weights():
    logq = torch.log_softmax(torch.tensor([[[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]]), -1)      # [1, 2, 3]
    cand = torch.tensor([[[5, 6, 7], [8, 9, 10]]])
    true = torch.tensor([[6, 4]])                                                       # depth 1: not a candidate
    loss, valid = weaver_loss(logq, cand, true, torch.ones(1, 2, dtype=torch.bool), cand[..., :1], torch.zeros(1, 2, 1),
                              kind="ce", weights=torch.tensor([1.0, 1.0]))
    assert valid.tolist() == [[True, False]]
    assert float(loss) == pytest.approx(-float(logq[0, 0, 1]))
    w = depth_weights(4, 2.0)
    assert torch.allclose(w, torch.exp(-torch.arange(4.0) / 2)) and depth_weights(3, None).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="'kl' or 'ce'"):
        weaver_loss(logq, cand, true, torch.ones(1, 2, dtype=torch.bool), cand[..., :1], torch.zeros(1, 2, 1),
                    kind="mse", weights=torch.ones(2))


def test_initial_weaver_proposes_dflash_marginals():
    cfg = WeaverConfig(d_model=16, d_embed=16, d_rank=8, num_layers=1, num_heads=2, mlp_dim=16, lookahead=3,
                       candidate_pool=5)
    g = torch.Generator().manual_seed(1)
    obj = WeaverObjective(initial_weaver(cfg, 0), torch.randn(30, 16, generator=g), torch.randn(30, 16, generator=g),
                          kind="kl", weights=torch.ones(3))
    b = {"h_final": torch.randn(2, 16, generator=g), "dflash_hidden": torch.randn(2, 3, 16, generator=g),
         "root_token": torch.tensor([1, 2]), "true_tokens": torch.tensor([[3, 4, -1], [5, 6, 7]]),
         "cand_ids": torch.randint(0, 30, (2, 3, 5), generator=g), "cand_logits": torch.randn(2, 3, 5, generator=g)}
    torch.testing.assert_close(obj.logq(b), torch.log_softmax(b["cand_logits"], -1))


def test_simulated_acceptance_on_hand_cases():
    true = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7]])
    argmax = torch.tensor([[4, 5, 9, 7], [4, 5, 6, 7]])                # row 0: the target leaves the continuation
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    n = truth_lengths(true, argmax, mask)
    assert n.tolist() == [2, 3]
    picks = torch.tensor([[4, 5, 6, 7], [4, 0, 6, 7]])
    assert chain_acceptance(picks, true, n).tolist() == [3, 2]
    #        0(root) -> 1:4 -> 3:5 -> 4:6 ; 0 -> 2:5
    tree = Tree(tokens=torch.tensor([1, 4, 5, 5, 6]), parents=torch.tensor([-1, 0, 0, 1, 3]),
                depths=torch.tensor([0, 1, 1, 2, 3]), draft_logprobs=torch.zeros(5, dtype=torch.float64))
    assert tree_acceptance(tree, [4, 5, 6, 7]) == 4
    assert tree_acceptance(tree, [5, 5]) == 2 and tree_acceptance(tree, [9]) == 1 and tree_acceptance(tree, []) == 1


def test_ddtree_from_candidates_uses_candidate_token_ids():
    cand = torch.tensor([[10, 11, 12], [20, 21, 22]])
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0]])
    t = ddtree_from_candidates(7, cand, logits, 3)
    assert t.tokens.tolist()[:3] == [7, 11, 22] and t.parents.tolist()[:3] == [-1, 0, 1]
    assert set(t.tokens.tolist()[1:]) <= {10, 11, 12, 20, 21, 22}


def test_batch_order_splits_ranks_and_is_a_function_of_the_step():
    o = BatchOrder(103, micro=4, accum=2, world=3, seed=5)
    assert o.steps_per_epoch == 103 // 24
    seen = np.concatenate([o.indices(s, m, r) for s in range(o.steps_per_epoch) for m in range(2) for r in range(3)])
    assert len(seen) == len(set(seen.tolist())) == o.steps_per_epoch * 24        # one epoch: no row twice
    again = BatchOrder(103, micro=4, accum=2, world=3, seed=5)
    late = o.steps_per_epoch + 1                                                # second epoch, fresh object
    assert np.array_equal(again.indices(late, 1, 2), o.indices(late, 1, 2))
    assert not np.array_equal(o.indices(0, 0, 0), o.indices(o.steps_per_epoch, 0, 0))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchOrder(10, micro=4, accum=2, world=2, seed=0)


def test_compiled_objective_matches_eager():
    """The `compile` setting wraps WeaverObjective.forward in torch.compile: same loss and gradients. On CUDA the
    training path's compiler (inductor); on the CPU, where training never compiles by default, the same graph
    capture and autograd tracing with the eager backend (inductor's CPU C++ build alone takes about a minute;
    test_train compiles a CPU run with inductor end to end)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "inductor" if dev == "cuda" else "aot_eager"
    cfg = WeaverConfig(d_model=16, d_embed=16, d_rank=8, num_layers=1, num_heads=2, mlp_dim=16, lookahead=3,
                       candidate_pool=5)
    g = torch.Generator().manual_seed(2)
    E, W = torch.randn(30, 16, generator=g), torch.randn(30, 16, generator=g)
    cand = torch.randint(0, 30, (4, 3, 5), generator=g)
    b = {"h_final": torch.randn(4, 16, generator=g), "dflash_hidden": torch.randn(4, 3, 16, generator=g),
         "root_token": torch.tensor([1, 2, 3, 4]), "true_tokens": cand[..., 0].clone(), "cand_ids": cand,
         "cand_logits": torch.randn(4, 3, 5, generator=g), "loss_mask": torch.ones(4, 3, dtype=torch.bool),
         "target_topk_ids": cand[..., :2].clone(), "target_topk_logprobs": torch.log_softmax(torch.randn(4, 3, 2), -1)}
    out = []
    for compiled in (False, True):
        weaver = initial_weaver(cfg, 0)
        torch.nn.init.normal_(weaver.lm_head_query_in.weight, std=0.1, generator=torch.Generator().manual_seed(3))
        obj = WeaverObjective(weaver.to(dev), E.to(dev), W.to(dev), kind="kl", weights=torch.ones(3, device=dev))
        if compiled:
            obj.forward = torch.compile(obj.forward, backend=backend)
        loss, _ = obj({k: v.to(dev) for k, v in b.items()})
        loss.backward()
        out.append((loss.detach(), weaver.lm_head_query_in.weight.grad.clone()))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])
    assert out[0][1].abs().sum() > 0


def test_train_config_validation_and_deepspeed_config(tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['lr_max'\\]"):
        TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "lr_max": 1})
    with pytest.raises(ValueError, match="missing required keys \\['output_dir'\\]"):
        TrainConfig.from_dict({"data": ["x"]})
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "model": "eagle"})
    with pytest.raises(ValueError, match="zero_stage"):
        TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "zero_stage": 4})
    p = tmp_path / "t.yaml"
    p.write_text("data: /shards\noutput_dir: /runs/a\nmicro_batch: 8\ngrad_accum: 3\nzero_stage: 2\n")
    c = TrainConfig.load(str(p))
    assert c.data == ["/shards"]
    ds = c.deepspeed_config(world_size=2, bf16=True)
    assert ds["train_batch_size"] == 48 and ds["zero_optimization"] == {"stage": 2, "compute_grad_norm": False} and ds["bf16"]["enabled"]
    with pytest.raises(ValueError, match="compile must be 'auto', 'on' or 'off'"):
        TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "compile": True})
    with pytest.raises(ValueError, match="score_group_rows must be >= 0"):
        TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "score_group_rows": -1})
    other = TrainConfig.from_dict({**c.to_dict(), "eval_every": 7, "output_dir": "/elsewhere", "compile": "off",
                                   "score_group_rows": 8})
    assert other.run_hash() == c.run_hash()                          # evaluation/paths do not change the trajectory
    assert TrainConfig.from_dict({**c.to_dict(), "lr": 1e-3}).run_hash() != c.run_hash()


def test_shard_data_refuses_missing_and_wrong_mode_folders(tmp_path):
    from pipelines.train.data import ShardData
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        ShardData([str(tmp_path)], mode="anchors", heldout_fraction=0.1, cache_dir=str(tmp_path / "c"))
    from tfm_runtime.worlds import tiny_world
    c = tiny_world("llama").contract
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "contract": c.to_dict(), "mode": "text_only",
                                                        "config": {"target_topk": 8}, "shards": {}}))
    with pytest.raises(ValueError, match="expected shards in 'anchors' mode"):
        ShardData([str(tmp_path)], mode="anchors", heldout_fraction=0.1, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no shards listed"):
        ShardData([str(tmp_path)], mode="text_only", heldout_fraction=0.1, cache_dir=str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c") or not os.listdir(tmp_path / "c")


def test_deepspeed_leaves_the_overflow_check_and_timing_to_the_trainer():
    """Non-finite steps are the optimizer's to skip (tests/test_train_integrity.py); DeepSpeed's own per-parameter
    scan and its throughput timer (which syncs the device twice a step) are off."""
    ds = TrainConfig.from_dict({"data": ["x"], "output_dir": "y"}).deepspeed_config(world_size=1, bf16=True)
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
    from deepspeed.utils.config import get_timers_config        # the throughput timer syncs the device twice a step
    assert not get_timers_config(ds).enabled


def test_clipped_adamw_matches_clip_grad_norm_then_adamw():
    """The trainer's on-device clipping (ZeRO 2) is torch's clip_grad_norm_ followed by AdamW, and its norm is the
    norm before clipping; max_norm 0 does not clip."""
    from pipelines.train.optim import ClippedAdamW, make_optimizer, owns_clipping
    gen = torch.Generator().manual_seed(0)
    for max_norm in (0.5, 1e6, 0.0):
        a = [torch.randn(5, 3, generator=gen).requires_grad_(), torch.randn(7, generator=gen).requires_grad_()]
        b = [p.detach().clone().requires_grad_() for p in a]
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=gen) * 3
            y.grad = x.grad.clone()
        ours = ClippedAdamW(a, max_norm=max_norm, partitioned=True, lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)
        ref = torch.optim.AdamW(b, lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)
        ours.step()
        norm = torch.nn.utils.clip_grad_norm_(b, max_norm if max_norm > 0 else float("inf"))
        ref.step()
        assert torch.allclose(ours.grad_norm, norm, rtol=1e-6)
        for x, y in zip(a, b):
            assert torch.allclose(x, y, rtol=1e-6, atol=1e-7), max_norm
    with pytest.raises(ValueError, match="one parameter group"):
        ClippedAdamW([{"params": a[:1]}, {"params": a[1:]}], max_norm=1.0, partitioned=True)
    assert owns_clipping(1) and owns_clipping(2) and not any(owns_clipping(s) for s in (0, 3))
    assert isinstance(make_optimizer(a, lr=1e-3, weight_decay=0.0, grad_clip=1.0, zero_stage=2,
                                     device=torch.device("cpu")), ClippedAdamW)
    for stage in (0, 1, 2):  # DeepSpeed clips (and computes the norm) only where the optimizer does not
        ds = TrainConfig.from_dict({"data": ["x"], "output_dir": "y", "zero_stage": stage}).deepspeed_config(1, True)
        assert (ds["gradient_clipping"] == 0.0) == (stage in (1, 2))
        assert ds["zero_optimization"].get("compute_grad_norm", True) == (stage not in (1, 2))


def test_dflash_objective_batches_sequences_exactly_as_one_at_a_time():
    """One padded target pass and one drafter pass over several sequences of different lengths give, in float64,
    the per-sequence terms summed: padding never reaches a real position, no block sees another sequence."""
    from pipelines.train.dflash_task import DFlashObjective, pick_anchors
    from tfm_runtime.worlds import tiny_world
    w = tiny_world("llama", dtype=torch.float64)
    obj = DFlashObjective(w.drafter, w.target, gamma=4.0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 250, (n,), generator=g) for n in (23, 9, 40)]
    anchors = [pick_anchors(len(s), 3, 5, g) for s in seqs]
    logits, labels, valid, argmax = obj.blocks(seqs, anchors, with_argmax=True)
    num, den = obj.weighted_ce(logits, labels, valid)
    parts = [obj.blocks([s], [a], with_argmax=True) for s, a in zip(seqs, anchors)]
    torch.testing.assert_close(logits, torch.cat([p[0] for p in parts]), rtol=1e-10, atol=1e-10)
    assert torch.equal(valid, torch.cat([p[2] for p in parts]))
    assert torch.equal(labels[valid], torch.cat([p[1] for p in parts])[valid])
    assert torch.equal(argmax[valid], torch.cat([p[3] for p in parts])[valid])
    n1, d1 = zip(*(obj.weighted_ce(*p[:3]) for p in parts))
    torch.testing.assert_close(num, sum(n1)), torch.testing.assert_close(den, sum(d1))
    assert not valid.all() and valid.any()                               # blocks run past a sequence's end
    want = torch.stack([w.target(s[None]).logits[0].argmax(-1) for s in seqs[2:]])[0]   # argmax of the last one
    a2 = anchors[2]
    pos = a2[:, None] + torch.arange(1, 8)
    ok = pos < 40
    assert torch.equal(parts[2][3][ok], want[(pos - 1)[ok]])
