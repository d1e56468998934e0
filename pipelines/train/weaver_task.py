"""Weaver training: teacher-forced chains over the L depths of each anchor row (docs/method.md §4.6-4.7), loss =
candidate-restricted KL to the target distribution (or cross-entropy on the true token), weighted by depth.

The trainer never runs the target: it reads only the target's input embedding and LM-head rows.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
import torch.nn as nn

from tfm_runtime.loading import ModelSpec, load_target
from tfm_runtime.models.dflash import dflash_candidates
from tfm_runtime.models.weaver import Weaver, WeaverConfig, WeaverScoring

FLOAT_COLUMNS = ("h_final", "dflash_hidden", "cand_logits")


def target_heads(spec, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, De], LM head [V, H]) of the target, frozen. A local safetensors folder is read
    tensor by tensor (two tensors, not the whole model); other targets are loaded through transformers."""
    files = sorted(glob.glob(os.path.join(spec.path, "*.safetensors"))) if os.path.isdir(spec.path) else []
    if files and not spec.gguf_file and not spec.tiny:
        from safetensors import safe_open
        found = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():                                   # noqa: SIM118 (safe_open has no iter)
                    for want in ("embed_tokens.weight", "lm_head.weight"):
                        if name.endswith(want) and "mtp" not in name and "draft" not in name:
                            found[want] = f.get_tensor(name)
        if "embed_tokens.weight" not in found:
            raise ValueError(f"target {spec.path}: no '*embed_tokens.weight' tensor in {len(files)} safetensors files")
        emb = found["embed_tokens.weight"]
        head = found.get("lm_head.weight", emb)                        # tied embeddings
    else:
        t = load_target(spec, [], torch.device("cpu"), torch.float32)
        emb, head = t.embed_weight.detach(), t.lm_head_weight.detach()
    return emb.to(device, dtype).contiguous(), head.to(device, dtype).contiguous()


def weaver_config(cfg, contract) -> WeaverConfig:
    if cfg.preset == "qwen36_27b":
        w = WeaverConfig.qwen36_27b()
        if (w.d_model, w.lookahead, w.candidate_pool) != (contract.target_hidden_size, contract.lookahead,
                                                         contract.candidate_pool):
            raise ValueError(f"preset qwen36_27b expects hidden 5120, lookahead 15, candidate pool 512; the shards "
                             f"have {contract.target_hidden_size}, {contract.lookahead}, {contract.candidate_pool}")
        return w
    return WeaverConfig(d_model=contract.target_hidden_size, d_embed=contract.target_hidden_size, d_rank=cfg.d_rank,
                        num_layers=cfg.num_layers, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
                        lookahead=contract.lookahead, candidate_pool=contract.candidate_pool)


def initial_weaver(wcfg: WeaverConfig, seed: int) -> Weaver:
    """Random blocks, zero residual (lm_head_query_in = 0): the initial Weaver proposes DFlash's marginals."""
    torch.manual_seed(seed)
    model = Weaver(wcfg)
    nn.init.zeros_(model.lm_head_query_in.weight)
    return model


def depth_weights(L: int, gamma: float | None) -> torch.Tensor:
    d = torch.arange(L, dtype=torch.float32)
    return torch.ones(L) if gamma is None else torch.exp(-d / gamma)


def weaver_loss(logq, cand_ids, true_tokens, loss_mask, topk_ids, topk_logprobs, *, kind: str, weights):
    """Per-row depth-weighted loss.

    logq [B, L, K] (log q over the candidates); cand_ids [B, L, K]; true_tokens, loss_mask [B, L];
    topk_ids, topk_logprobs [B, L, k] (the target's top-k along the true continuation); weights [L].
    kl: sum_c pbar_c (log pbar_c - log q_c), pbar = target probs of the candidates (those in its top-k),
        renormalised; depths where no candidate is in the target's top-k carry no loss.
    ce: -log q(true token), at depths whose true token is a candidate.
    Returns (loss scalar, depth-valid mask [B, L]).
    """
    if kind == "kl":
        match = cand_ids[..., None, :] == topk_ids[..., :, None]                         # [B, L, k, K]
        p = (topk_logprobs.to(logq.dtype).exp()[..., None] * match).sum(-2)                  # [B, L, K]
        mass = p.sum(-1)                                                                  # [B, L]
        valid = loss_mask & (mass > 0)
        pbar = p / mass.clamp_min(1e-30)[..., None]
        per = (torch.xlogy(pbar, pbar) - pbar * logq).sum(-1)                             # [B, L]
    elif kind == "ce":
        hit = cand_ids == true_tokens[..., None]                                          # [B, L, K]
        valid = loss_mask & hit.any(-1)
        per = -(logq * hit).sum(-1)
    else:
        raise ValueError(f"loss must be 'kl' or 'ce', got {kind!r}")
    w = weights.to(logq.device)[None] * valid                                             # [B, L]
    return (per * w).sum() / w.sum().clamp_min(1e-9), valid


class WeaverObjective(nn.Module):
    """The module DeepSpeed trains: forward(batch) -> (loss, valid depths). The frozen embedding and LM head are
    plain attributes (not parameters, not buffers: never optimized, gathered or checkpointed); `scoring` is how
    the Weaver scores the candidates (`WeaverScoring`)."""

    def __init__(self, weaver: Weaver, embed: torch.Tensor, lm_head: torch.Tensor, *, kind: str,
                 weights: torch.Tensor, scoring: WeaverScoring = WeaverScoring()):
        super().__init__()
        self.weaver, self.kind, self.scoring = weaver, kind, scoring
        # the depth weights live with the LM head: a host tensor would be copied (and waited for) every step
        object.__setattr__(self, "frozen", (embed, lm_head, weights.to(lm_head.device)))

    def logq(self, b: dict) -> torch.Tensor:
        embed, lm_head, _ = self.frozen
        chain = torch.cat([b["root_token"][:, None], b["true_tokens"][:, :-1].clamp_min(0)], dim=1)   # [B, L]
        return self.weaver.forward_chain(b["h_final"], b["dflash_hidden"], chain, b["cand_ids"], b["cand_logits"],
                                         embed, lm_head, self.scoring)

    def forward(self, b: dict):
        return weaver_loss(self.logq(b), b["cand_ids"], b["true_tokens"], b["loss_mask"], b["target_topk_ids"],
                           b["target_topk_logprobs"], kind=self.kind, weights=self.frozen[2])


def to_batch(rows: dict[str, np.ndarray], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, arr in rows.items():
        t = torch.from_numpy(np.array(arr))                  # a writable copy (Arrow buffers are read-only)
        if name in FLOAT_COLUMNS:
            t = t.to(dtype)
        elif name == "target_topk_logprobs":
            t = t.float()
        elif t.dtype != torch.bool:
            t = t.long()
        # pinned and asynchronous: a pageable copy waits for the GPU to finish the steps already queued
        out[name] = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
    return out


def heldout_metrics(objective: WeaverObjective, b: dict, logq: torch.Tensor) -> dict[str, float]:
    """Loss, per-depth candidate hit rate and top-1 agreement (Weaver and DFlash) with the target's argmax.
    logq [B, L, K] = objective.logq(b)."""
    with torch.no_grad():
        loss, _ = weaver_loss(logq, b["cand_ids"], b["true_tokens"], b["loss_mask"], b["target_topk_ids"],
                              b["target_topk_logprobs"], kind=objective.kind, weights=objective.frozen[2])
    mask = b["loss_mask"]
    n = mask.sum(0).clamp_min(1).float()                                                  # [L]
    hit = (b["cand_ids"] == b["true_tokens"][..., None]).any(-1) & mask
    tgt = b["target_topk_ids"][..., 0]
    pick_w = b["cand_ids"].gather(-1, logq.argmax(-1, keepdim=True))[..., 0]
    pick_d = b["cand_ids"].gather(-1, b["cand_logits"].float().argmax(-1, keepdim=True))[..., 0]
    out = {"loss": float(loss)}
    for name, v in (("hit_rate", hit), ("top1_weaver", (pick_w == tgt) & mask), ("top1_dflash", (pick_d == tgt) & mask)):
        per = (v.sum(0) / n).tolist()
        out[name] = float(v.sum() / mask.sum().clamp_min(1))
        out[f"{name}_by_depth"] = [round(x, 4) for x in per]
    return out


def save_weaver(weaver: Weaver, path: str, contract, step: int, metrics: dict | None) -> None:
    """config.json (+ training step and held-out metrics under "tfm") + model.safetensors + contract.json: the
    folder `tfm_runtime.load_adapter` reads and validates."""
    extra = {"tfm": {"step": step, "metrics": json.loads(json.dumps(metrics or {}, default=float))}}
    weaver.save_pretrained(path, extra_config=extra)
    contract.save(os.path.join(path, "contract.json"))


def flops_per_row(wcfg: WeaverConfig) -> float:
    """Training FLOPs per anchor row (forward + backward = 3x forward) of a teacher-forced chain: the 2L+1 token
    positions through the blocks, the attention scores, and the K candidate-row scores per depth.

    The usual MFU convention (6 FLOPs per parameter per token, plus attention, all at 3x the forward). The step
    executes 4.3% fewer at the Qwen3.6-27B preset: the two input projections need no input gradient (their
    inputs are data and the frozen embedding) and the frozen LM head's candidate scores no weight gradient."""
    r, m, L, K, d = wcfg.d_rank, wcfg.mlp_dim, wcfg.lookahead, wcfg.candidate_pool, wcfg.d_model
    T = 2 * L + 1
    per_token = 2 * (4 * r * r + 3 * r * m)
    attn = 2 * 2 * T * T * r
    proj = 2 * (L + 1) * d * r + 2 * L * wcfg.d_embed * r + 2 * L * r * d + 2 * L * K * d
    fwd = wcfg.num_layers * (T * per_token + attn) + proj
    return 3.0 * fwd


class WeaverTask:
    """Data, objective, evaluation and artifact of Weaver training (what the generic loop needs)."""

    name = "weaver"

    def __init__(self, cfg, device: torch.device, dtype: torch.dtype):
        from pipelines.train.data import open_run_data
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.data, self.eval_index = open_run_data(cfg, "anchors")
        c = self.contract = self.data.contract
        if cfg.score_group_rows * c.lookahead > 128:                  # before the LM head is read
            raise ValueError(f"train config: score_group_rows x lookahead must be <= 128 queries per group, got "
                             f"{cfg.score_group_rows} x {c.lookahead}")
        # Shards collected with store_candidates: false (half the bytes) get their candidates recomputed here.
        self.recompute_candidates = "cand_ids" not in self.data.shapes
        spec = cfg.target or ModelSpec(c.target_id, c.target_revision)
        embed, head = target_heads(spec, device, dtype)
        want = (c.vocab_size, c.target_hidden_size)
        if tuple(head.shape) != want or embed.shape[0] != c.vocab_size:
            raise ValueError(f"target {spec.path}: LM head {tuple(head.shape)} / embedding {tuple(embed.shape)}, the "
                             f"shards' contract expects [vocab, hidden] = {list(want)}")
        self.wcfg = weaver_config(cfg, c)
        self.objective = WeaverObjective(initial_weaver(self.wcfg, cfg.seed), embed, head, kind=cfg.loss,
                                         weights=depth_weights(self.wcfg.lookahead, cfg.depth_gamma),
                                         scoring=WeaverScoring(group_rows=cfg.score_group_rows))
        self.train_index = self.data.train_index
        self.flops_per_item = flops_per_row(self.wcfg)

    def rows(self, index: np.ndarray) -> dict:
        b = to_batch(self.data.rows(index), self.device, self.dtype)
        if self.recompute_candidates:
            b["cand_ids"], b["cand_logits"] = dflash_candidates(b["dflash_hidden"], self.objective.frozen[1],
                                                                self.wcfg.candidate_pool, chunk=8)
        return b

    def batch(self, positions: np.ndarray, step: int = 0, micro: int = 0, rank: int = 0) -> dict:
        return self.rows(self.train_index[positions])

    def evaluate(self, objective: WeaverObjective) -> dict:
        from pipelines.train.evaluate import weaver_acceptance
        b = self.rows(self.eval_index)
        with torch.no_grad():
            logq = objective.logq(b)                                                      # [B, L, K]
        out = heldout_metrics(objective, b, logq)
        out.update(weaver_acceptance(objective, b, logq, sorted(self.cfg.eval_budgets)))
        out["score"] = out[f"accept_weaver_{max(self.cfg.eval_budgets)}"]
        out["rows"] = len(self.eval_index)
        return out

    def save_model(self, objective: WeaverObjective, path: str, step: int, metrics: dict | None) -> None:
        save_weaver(objective.weaver, path, self.contract, step, metrics)
