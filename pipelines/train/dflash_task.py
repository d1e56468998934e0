"""DFlash drafter training for targets that have none (docs/method.md §2.4), from target-regenerated sequences
(collect's text-only shards), with the target's tap features computed here (online; small targets).

Per sequence and step: random anchors a in [max(1, prompt_len), T-2]; block a = [x_a, MASK x (S-1)] at positions
a..a+S-1 sees the context features at positions < a and its own block (`DFlashDrafter.forward_blocks`); block
position k predicts x_{a+k}, weighted exp(-(k-1)/gamma). Anchors come from a generator keyed by
(seed, step, micro step, rank, sequence): resuming needs no random state. Saved in z-lab's DFlash layout.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tfm_runtime.io import atomic_write_json
from tfm_runtime.loading import ModelSpec, load_target
from tfm_runtime.models import TargetModel
from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
from tfm_runtime.models.target import default_tap_layers


def drafter_config(cfg, target, mask_token_id: int) -> DFlashConfig:
    """A drafter shaped like the target's layers (heads, head dim, rope), `cfg.drafter_layers` deep."""
    c = target.model.config
    H, n = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = getattr(c, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 1e4
    return DFlashConfig(hidden_size=H, intermediate_size=cfg.drafter_intermediate_size or 2 * H,
                        num_hidden_layers=cfg.drafter_layers, num_attention_heads=heads,
                        num_key_value_heads=getattr(c, "num_key_value_heads", heads) or heads,
                        head_dim=getattr(c, "head_dim", None) or H // heads, vocab_size=c.vocab_size,
                        num_target_layers=n, target_layer_ids=default_tap_layers(n, cfg.drafter_layers),
                        mask_token_id=mask_token_id, block_size=cfg.block_size, rope_theta=float(theta),
                        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6))


def block_weights(S: int, gamma: float) -> torch.Tensor:
    """[S-1] weights of block positions k = 1..S-1: exp(-(k-1)/gamma)."""
    return torch.exp(-torch.arange(S - 1, dtype=torch.float32) / gamma)


class DFlashObjective(nn.Module):
    """forward(batch) -> (weighted CE over all blocks of the batch, number of scored positions).

    One target forward over the right-padded sequences of the micro batch (causal: padding never changes a real
    position) and one drafter pass over all their blocks."""

    def __init__(self, drafter: DFlashDrafter, target, gamma: float):
        super().__init__()
        self.drafter = drafter
        object.__setattr__(self, "target", target)                 # frozen: not a submodule
        self.register_buffer("weights", block_weights(drafter.cfg.block_size, gamma), persistent=False)

    def blocks(self, seqs: list[torch.Tensor], anchors: list[torch.Tensor], *, with_argmax: bool = False):
        """seqs: B sequences [T_b]; anchors: B tensors [A_b] of block starts -> (logits [A, S-1, V] fp32,
        labels [A, S-1], valid [A, S-1], the target's argmax after each labelled position's predecessor
        [A, S-1] or None), A = sum of A_b."""
        S, dev = self.drafter.cfg.block_size, self.weights.device
        lens = torch.tensor([len(x) for x in seqs], device=dev)                       # [B]
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)                  # [B, T]
        T = ids.shape[1]
        seq_index = torch.cat([torch.full((len(a),), b, device=dev) for b, a in enumerate(anchors)])   # [A]
        anchor = torch.cat(anchors)                                                    # [A]
        with torch.no_grad():
            out = self.target(ids, logits=False)                                       # taps [B, T, n_taps*H]
        dt = next(self.drafter.parameters()).dtype
        blk = torch.full((anchor.shape[0], S), self.drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        blk[:, 0] = ids[seq_index, anchor]
        emb = F.embedding(blk, self.target.embed_weight).to(dt)                        # [A, S, H]
        hidden = self.drafter.forward_blocks(out.taps.to(dt), anchor, emb, seq_index)  # [A, S, H]
        logits = (hidden[:, 1:] @ self.target.lm_head_weight.to(dt).T).float()         # [A, S-1, V]
        pos = anchor[:, None] + torch.arange(1, S, device=dev)                         # [A, S-1]
        valid = pos < lens[seq_index][:, None]
        pos = pos.clamp(max=T - 1)
        labels = ids[seq_index[:, None], pos]
        argmax = None
        if with_argmax:
            with torch.no_grad():
                argmax = self.target.head(out.h_final[seq_index[:, None], pos - 1]).argmax(-1)   # [A, S-1]
        return logits, labels, valid, argmax

    def weighted_ce(self, logits, labels, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sum of w_k * CE over valid positions, sum of their weights)."""
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        w = self.weights[None] * valid
        return (ce * w).sum(), w.sum()

    def forward(self, batch: dict):
        keep = [i for i, a in enumerate(batch["anchors"]) if a.numel()]
        if not keep:
            zero = self.weights.sum() * 0
            return zero, zero
        num, den = self.weighted_ce(*self.blocks([batch["seqs"][i] for i in keep],
                                                 [batch["anchors"][i] for i in keep])[:3])
        return num / den.clamp_min(1e-9), den


def pick_anchors(T: int, prompt_len: int, count: int, g: torch.Generator) -> torch.Tensor:
    lo, hi = max(1, prompt_len), T - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    n = hi - lo + 1
    return (torch.randperm(n, generator=g)[:count].sort().values + lo).long()


class DFlashTask:
    name = "dflash"

    def __init__(self, cfg, device: torch.device, dtype: torch.dtype):
        from pipelines.train.data import open_run_data
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.data, self.eval_index = open_run_data(cfg, "text_only")
        c = self.contract = self.data.contract
        spec = cfg.target or ModelSpec(c.target_id, c.target_revision)
        plain = load_target(spec, [], device, dtype)                      # loaded once; taps known after
        dcfg = drafter_config(cfg, plain, c.mask_token_id)
        self.target = TargetModel(plain.model, dcfg.target_layer_ids)
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(cfg.seed)
        self.objective = DFlashObjective(DFlashDrafter(dcfg), self.target, cfg.loss_decay_gamma)
        self.train_index = self.data.train_index
        self.flops_per_item = None

    def _batch(self, index: np.ndarray, seed_of) -> dict:
        rows = self.data.rows(index)
        seqs, anchors = [], []
        for j, (ids, P, sid) in enumerate(zip(rows["input_ids"], rows["prompt_len"], rows["sample_id"])):
            ids = ids[:self.cfg.max_seq_len]
            g = torch.Generator().manual_seed(seed_of(j, int(sid)))
            seqs.append(torch.from_numpy(ids).long().to(self.device))
            anchors.append(pick_anchors(len(ids), int(P), self.cfg.anchors_per_sequence, g).to(self.device))
        return {"seqs": seqs, "anchors": anchors}

    def batch(self, positions: np.ndarray, step: int = 0, micro: int = 0, rank: int = 0) -> dict:
        key = ((self.cfg.seed * 1_000_003 + step) * 101 + micro) * 1009 + rank
        return self._batch(self.train_index[positions], lambda j, sid: key * 7919 + j)

    @torch.no_grad()
    def evaluate(self, objective: DFlashObjective) -> dict:
        """Held-out: weighted CE, per-position top-1 accuracy, and the simulated greedy chain acceptance length
        (1 + leading drafted tokens equal to the target's argmax, the continuation being the target's argmax)."""
        b = self._batch(self.eval_index, lambda j, sid: self.cfg.seed * 1_000_003 + sid)
        S = objective.drafter.cfg.block_size
        hits, counts, accept = torch.zeros(S - 1), torch.zeros(S - 1), []
        num, den = 0.0, 0.0
        keep = [i for i, a in enumerate(b["anchors"]) if a.numel()]
        for lo in range(0, len(keep), self.cfg.micro_batch):                 # micro-batch-sized target passes
            part = keep[lo:lo + self.cfg.micro_batch]
            logits, labels, valid, argmax = objective.blocks([b["seqs"][i] for i in part],
                                                             [b["anchors"][i] for i in part], with_argmax=True)
            n, d = objective.weighted_ce(logits, labels, valid)
            num, den = num + float(n), den + float(d)
            truth = valid & (labels == argmax)                                # greedy-acceptable
            hit = (logits.argmax(-1) == labels) & valid
            hits += hit.sum(0).cpu().float()
            counts += valid.sum(0).cpu().float()
            accept += (1 + (hit & truth).long().cumprod(-1).sum(-1)).tolist()
        acc = (hits / counts.clamp_min(1)).tolist()
        return {"loss": num / max(den, 1e-9), "accept_chain": sum(accept) / max(1, len(accept)),
                "top1_by_position": [round(x, 4) for x in acc], "blocks": len(accept),
                "score": sum(accept) / max(1, len(accept))}

    def save_model(self, objective: DFlashObjective, path: str, step: int, metrics: dict | None) -> None:
        objective.drafter.save_pretrained(path)
        atomic_write_json(os.path.join(path, "tfm_train.json"),
                          {"step": step, "metrics": json.loads(json.dumps(metrics or {}, default=float)),
                           "target": self.contract.target_id})
