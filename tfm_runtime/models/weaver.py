"""Weaver: a small autoregressive adapter that re-scores DFlash's top-K candidates along tree paths.

Data flow per draft round (docs/method.md §4.1-4.4, §4.6):
  prefix  = causal blocks over [proposal_in(output_norm(h_final)), proposal_in(output_norm(u_1..u_L))]   (1+L)
  node    = token_in(embed_norm(E[token])) at RoPE position depth+1, attends to the prefix, its ancestors, itself
  score   = DFlash logit_c + (W_lm[c] . lm_head_query_in(out_norm(x)))   for the K candidates c of its depth
  log q   = log-softmax over the K candidates (never a full-vocabulary projection)
The target's embedding E [V, d_embed] and LM head W_lm [V, d_model] are passed in, never copied.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tfm_runtime.models.common import (RMSNorm, apply_rope, inference_kernel_ok, kernel_device, load_safetensors_dir,
                                       load_strict, rope_cos_sin, save_safetensors_dir, small_linear_ok)

if TYPE_CHECKING:
    from tfm_kernels.candidate_logits.grouped import GroupedTuning


@dataclass
class WeaverConfig:
    d_model: int               # target hidden size (h_final, DFlash hidden, LM-head rows)
    d_embed: int               # target input-embedding width
    d_rank: int                # Weaver width r
    num_layers: int
    num_heads: int
    mlp_dim: int
    lookahead: int             # L: DFlash depths scored (block_size - 1)
    candidate_pool: int        # K: DFlash top-K candidates per depth
    rope_base: float = 1e4
    rms_eps: float = 1e-6
    architecture: str = "Weaver"

    def __post_init__(self):
        if self.d_rank % self.num_heads or (self.d_rank // self.num_heads) % 2:
            raise ValueError(f"d_rank={self.d_rank} must split into num_heads={self.num_heads} even-sized heads")

    @classmethod
    def qwen36_27b(cls) -> "WeaverConfig":
        """Sizes for Qwen3.6-27B (hidden 5120, DFlash block 16, top-512): ~56.6M parameters (published: 56.7M)."""
        return cls(d_model=5120, d_embed=5120, d_rank=1024, num_layers=3, num_heads=8, mlp_dim=3072,
                   lookahead=15, candidate_pool=512)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WeaverConfig":
        if d.get("architecture", "Weaver") != "Weaver":
            raise ValueError(f"not a Weaver config: architecture={d.get('architecture')!r}")
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def small_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(hd), masked) v for the few keys Weaver has (T, S <= ~2L+1+nodes): q [B, nh, T, hd],
    k, v [B, nh, S, hd], mask bool broadcastable to [B, nh, T, S] (every row sees at least itself) -> [B, nh, T, hd].

    On CUDA with one [T, S] mask for all rows and heads (training, the prefix) and T, S <= 128, hd <= 256: the fused
    Triton kernel of `tfm_kernels.small_attention` (one launch per layer forward and one backward, each reading every
    q/k/v tile once, where cuBLAS runs the batched 31 x 31 products on old cutlass_75 WMMA kernels). Its o is a
    view of a [B, T, nh, hd] tensor. Otherwise (CPU, float64, per-row masks of the node steps):
    `_small_attention_bmm`."""
    T, S, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    if (kernel_device(q) and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and 0 < T <= 128 and 0 < S <= 128
            and hd <= 256 and (mask.dim() == 2 or (mask.dim() == 4 and mask.shape[:2] == (1, 1)))):
        from tfm_kernels.small_attention import small_attention as fused_small_attention
        return fused_small_attention(q, k, v, mask)
    return _small_attention_bmm(q, k, v, mask)


def chain_mask(L: int, device=None) -> torch.Tensor:
    """The attention mask of `Weaver.forward_chain`: [2L+1, 2L+1] bool over (prefix 0..L, chain nodes 1..L); the prefix
    is causal, each chain node sees the whole prefix and the chain nodes up to itself."""
    T = 2 * L + 1
    mask = torch.zeros(T, T, dtype=torch.bool, device=device)
    mask[: L + 1, : L + 1] = torch.ones(L + 1, L + 1, dtype=torch.bool, device=device).tril()
    mask[L + 1:, : L + 1] = True
    mask[L + 1:, L + 1:] = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    return mask


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate, up] [..., 2F] -> [..., F]. On CUDA the Triton kernel of `tfm_kernels.swiglu`
    (its backward reads gate and up once and writes their gradient in place of a concatenation)."""
    if kernel_device(gate_up) and gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from tfm_kernels.swiglu import swiglu as fused_swiglu
        return fused_swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, lin: nn.Linear, *, norm: RMSNorm | None = None, index: torch.Tensor | None = None,
           act_swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + act(lin(norm(x))), each part optional: x [..., in] (with `index` [...]: a table [V, in] read at
    those rows, an embedding lookup) -> [..., out] (act_swiglu: `swiglu` of lin's [gate, up] output, out = half of
    lin's). In CUDA inference over the rows and weights `tfm_kernels.small_linear` is for (the tree build's steps,
    `small_linear_ok`): one launch of it with the same roundings; otherwise the modules one after the other."""
    nw, nb = (norm.weight, norm.bias) if norm is not None else (None, None)
    rows = index.numel() if index is not None else x.numel() // max(x.shape[-1], 1)
    if small_linear_ok(x, rows, (lin.weight,), lin.bias, nw, nb, residual):
        from tfm_kernels.small_linear import small_linear
        return small_linear(x, lin.weight, lin.bias, index=index, norm_weight=nw, norm_bias=nb,
                            eps=norm.eps if norm is not None else 0.0, swiglu=act_swiglu, residual=residual)
    if index is not None:
        h = norm.rows(x, index) if norm is not None else F.embedding(index, x)
    else:
        h = norm(x) if norm is not None else x
    y = lin(h)
    y = swiglu(y) if act_swiglu else y
    return y if residual is None else residual + y


def _small_attention_bmm(q, k, v, mask):
    """`small_attention` as two batched matmuls and an fp32 softmax that torch.compile fuses (any mask shape).

    Written out rather than through scaled_dot_product_attention: its fused kernels tile 64-128 keys, so at
    T = 31 they spend most of their time on padding."""
    scores = q @ k.transpose(-1, -2)                                                    # [B, nh, T, S]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * q.shape[-1] ** -0.5
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.to(v.dtype) @ v


class WeaverBlock(nn.Module):
    def __init__(self, cfg: WeaverConfig):
        super().__init__()
        r, self.nh = cfg.d_rank, cfg.num_heads
        self.attn_norm = RMSNorm(r, cfg.rms_eps)
        self.qkv_proj = nn.Linear(r, 3 * r, bias=False)
        self.o_proj = nn.Linear(r, r, bias=False)
        self.mlp_norm = RMSNorm(r, cfg.rms_eps)
        self.gate_up_proj = nn.Linear(r, 2 * cfg.mlp_dim)
        self.down_proj = nn.Linear(cfg.mlp_dim, r)

    def qkv(self, x, cos, sin, positions=None, k_out=None, v_out=None):
        """x [B, T, r] (the residual stream, before attn_norm); cos, sin [B, T, hd] or [T, hd], or tables [P, hd] read
        at positions [B, T] -> q, k, v [B, nh, T, hd] (q, k rotated). k_out, v_out [B, nh, T, hd] (e.g. a static K/V
        cache's next slots): k and v are written there and returned as k, v. In CUDA inference over a few rows
        (cos, sin tables) one launch of `tfm_kernels.small_linear.small_qkv_rope`, the norm and the rotation
        included; over more, `linear` then one launch of `tfm_kernels.rope`."""
        B, T, r = x.shape
        norm = self.attn_norm
        if cos.dim() == 2 and small_linear_ok(x, B * T, (self.qkv_proj.weight,), norm.weight, norm.bias, cos, sin,
                                              k_out, v_out):
            from tfm_kernels.small_linear import small_qkv_rope
            return small_qkv_rope(x, self.qkv_proj.weight, self.nh, cos, sin, positions, norm_weight=norm.weight,
                                  norm_bias=norm.bias, eps=norm.eps, k_out=k_out, v_out=v_out)
        qkv = linear(x, self.qkv_proj, norm=norm).view(B, T, 3, self.nh, r // self.nh)              # [B,T,3,nh,hd]
        if inference_kernel_ok(qkv, cos, sin, self.qkv_proj.weight):
            from tfm_kernels.rope import rope_qk
            q, k = rope_qk(qkv, cos, sin, positions=positions, k_out=k_out, v_out=v_out)
            return q, k, (qkv[:, :, 2].transpose(1, 2) if v_out is None else v_out)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]                                    # [B, T, hd]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k_out is not None:
            k, v = k_out.copy_(k), v_out.copy_(v)
        return q, k, v

    def finish(self, x, q, k, v, mask):
        """Attention of q over (k, v) with boolean mask [B, 1, T, S], then the MLP, each with its residual add
        -> x [B, T, r] (in CUDA inference over a few rows: the attention's launch and three of `linear`)."""
        B, _, T, hd = q.shape
        o = small_attention(q, k, v, mask).transpose(1, 2).reshape(B, T, self.nh * hd)   # [B, T, r]
        gu, norm = self.gate_up_proj, self.mlp_norm
        if small_linear_ok(x, B * T, (self.o_proj.weight, gu.weight), gu.bias, norm.weight, norm.bias):
            x = linear(o, self.o_proj, residual=x)
            y = linear(x, gu, norm=norm, act_swiglu=True)                                # [B, T, mlp]
        else:                                         # the residual add and the norm after it: one launch on CUDA
            x, h = norm.add(x, self.o_proj(o))
            y = swiglu(gu(h))
        return linear(y, self.down_proj, residual=x)


@dataclass(frozen=True)
class WeaverScoring:
    """How `Weaver.score` computes the candidate scores on CUDA (fp16/bf16/fp32; CPU and float64 always take
    weight[cand] + bmm). The choices give the same log q up to rounding.

    kernels: the Triton kernels of `tfm_kernels.candidate_logits`, which gather the candidates' LM-head rows in both
        passes; False: weight[cand] + bmm, which materialises [..., K, d_model].
    group_rows: > 0: score groups of this many rows (x L depths) over their distinct LM-head rows
        (`grouped_candidate_log_probs`; for [rows, L, K] candidates); 0: one gather per (row, depth, candidate).
    tuning: launch parameters of the grouped scoring (a `GroupedTuning`; None: its default for the shape).
    """
    kernels: bool = True
    group_rows: int = 0
    tuning: GroupedTuning | None = None

    def __post_init__(self):
        if self.group_rows < 0:
            raise ValueError(f"group_rows must be >= 0, got {self.group_rows}")


class WeaverState:
    """Per-round K/V of every layer: the prefix [B, nh, P = 1+L, hd], then the tree-node slots.

    Grown by `Weaver.step` (each step concatenates its W new slots: k[i] [B, nh, P+Nt, hd]), or, built by
    `WeaverState.static`, held in buffers k[i], v[i] [B, nh, P+capacity, hd] allocated once: a step then writes its
    W slots in place at P+Nt .. P+Nt+W-1 and attends over the view of the first P+Nt+W keys, the same keys in the
    same order as the growing state, so every step has a fixed shape and address (CUDA-graph capturable).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], capacity: int | None = None,
                 prefix_len: int | None = None):
        self.k, self.v = k, v
        self.capacity = capacity
        self.prefix_len = k[0].shape[2] if prefix_len is None else prefix_len
        self._nodes = 0                             # filled node slots of a static state

    @classmethod
    def static(cls, num_layers: int, batch: int, num_heads: int, prefix_len: int, head_dim: int, capacity: int,
               device=None, dtype=None) -> "WeaverState":
        """A state with K/V buffers [batch, num_heads, prefix_len + capacity, head_dim] per layer (zeros); `reset`
        loads a prefix into it."""
        shape = (batch, num_heads, prefix_len + capacity, head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        return cls(k, v, capacity=capacity, prefix_len=prefix_len)

    @property
    def num_nodes(self) -> int:
        return self.k[0].shape[2] - self.prefix_len if self.capacity is None else self._nodes

    def reset(self, prefix: "WeaverState") -> None:
        """Static state: copy the prefix K/V of `prefix` (a state from `Weaver.prefix`) in place; no node slots."""
        if self.capacity is None or prefix.prefix_len != self.prefix_len:
            raise ValueError(f"reset needs a static state and a prefix of length {self.prefix_len}")
        for dst, src in zip(self.k + self.v, prefix.k + prefix.v):
            dst[:, :, : self.prefix_len].copy_(src)
        self._nodes = 0

    def clear(self) -> None:
        """Static state: no node slots (the prefix K/V stay)."""
        self._nodes = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, nh, W, hd] of W new slots for `layer` -> that layer's K/V over prefix, old and new slots
        [B, nh, P+Nt+W, hd]. A growing state concatenates; a static one writes in place (call `advance` after the
        last layer)."""
        if self.capacity is None:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
            return self.k[layer], self.v[layer]
        k_new, v_new = self.slots(layer, k.shape[2])
        k_new.copy_(k), v_new.copy_(v)
        return self.keys(layer, k.shape[2])

    def slots(self, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static state: views [B, nh, width, hd] of `layer`'s next `width` node slots (to be written in place)."""
        start = self.prefix_len + self._nodes
        if self.capacity is None or self._nodes + width > self.capacity:
            raise ValueError(f"static WeaverState holds {self.capacity} node slots, a step needs "
                             f"{self._nodes + width}" if self.capacity else "slots needs a static WeaverState")
        return self.k[layer][:, :, start:start + width], self.v[layer][:, :, start:start + width]

    def keys(self, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static state: `layer`'s K/V over the prefix, the filled slots and the next `width` [B, nh, P+Nt+W, hd]."""
        end = self.prefix_len + self._nodes + width
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, width: int) -> None:
        """Count `width` more filled node slots (a static state; a growing one counts its K/V length)."""
        if self.capacity is not None:
            self._nodes += width


class Weaver(nn.Module):
    """`contract`: the setup the adapter was trained for (a Contract; `load_adapter` sets it with `commit_sha` and
    `source`), which SpeculativeDecoder checks against its target and drafter; None for an adapter built in code."""

    def __init__(self, cfg: WeaverConfig):
        super().__init__()
        self.cfg = cfg
        self.contract, self.commit_sha, self.source = None, None, None
        self.output_norm = RMSNorm(cfg.d_model, cfg.rms_eps, bias=True)
        self.embed_norm = RMSNorm(cfg.d_embed, cfg.rms_eps, bias=True)
        self.proposal_in = nn.Linear(cfg.d_model, cfg.d_rank)
        self.token_in = nn.Linear(cfg.d_embed, cfg.d_rank)
        self.blocks = nn.ModuleList(WeaverBlock(cfg) for _ in range(cfg.num_layers))
        self.out_norm = RMSNorm(cfg.d_rank, cfg.rms_eps)
        self.lm_head_query_in = nn.Linear(cfg.d_rank, cfg.d_model, bias=False)
        self._rope_tables: dict = {}                      # cos, sin (and the prefix's causal mask) made once

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _rope(self, pos: torch.Tensor, dtype):
        return rope_cos_sin(pos, self.cfg.d_rank // self.cfg.num_heads, self.cfg.rope_base, dtype)

    def _node_rope(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [lookahead+1, hd]: row d holds position d + 1, a node at depth d (the same values as
        `_rope`), made once per device and dtype; a step reads them by depth (in CUDA inference inside the rotary
        kernel)."""
        key = (device, dtype)
        if key not in self._rope_tables:
            pos = torch.arange(1, self.cfg.lookahead + 2, device=device)                  # depth d at position d + 1
            self._rope_tables[key] = self._rope(pos, dtype)                                # [lookahead+1, hd] each
        return self._rope_tables[key]

    # ---- inference: prefix once per round, then batched node steps ----------------------------------
    def prefix(self, h_final: torch.Tensor, u: torch.Tensor, into: WeaverState | None = None) -> WeaverState:
        """h_final [B, H], u [B, L, H] -> WeaverState holding the causal prefix K/V of every layer. `into`: a static
        state (`WeaverState.static`, prefix length 1 + L) that takes the K/V in place and is returned, with no node
        slots (as `reset` with a new prefix, without its copies)."""
        x = linear(torch.cat([h_final[:, None], u], dim=1), self.proposal_in, norm=self.output_norm)   # [B, 1+L, r]
        T = x.shape[1]
        key = ("prefix", T, x.device, x.dtype)
        if key not in self._rope_tables:                  # positions 0..T-1 and the causal mask: made once
            cos, sin = self._rope(torch.arange(T, device=x.device), x.dtype)                # [T, hd] each
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]   # [1, 1, T, T]
            self._rope_tables[key] = cos, sin, causal
        cos, sin, causal = self._rope_tables[key]
        if into is not None and (into.capacity is None or into.prefix_len != T):
            raise ValueError(f"prefix into a state needs a static state with prefix length {T}")
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            out = () if into is None else (into.k[i][:, :, :T], into.v[i][:, :, :T])      # [B, nh, T, hd] views
            q, k, v = blk.qkv(x, cos, sin, None, *out)
            ks.append(k), vs.append(v)
            if i + 1 < len(self.blocks):              # the last block's output is not part of the state
                x = blk.finish(x, q, k, v, causal)
        if into is None:
            return WeaverState(ks, vs)
        into.clear()
        return into

    def step(self, state: WeaverState, tokens: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor | None,
             embed_weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One batched expansion of W new nodes; their K/V are appended to `state` (in place for a static state).

        tokens, depths [B, W]; visible [B, W, Nt] bool: which existing tree nodes are ancestors of each new node
        (new nodes never see each other, only themselves). Or `mask` [B, 1, W, P+Nt+W] bool, the attention mask itself
        (the prefix, each node's ancestors and itself; `visible` is then not read). Returns h [B, W, r], the
        residual stream (`score` applies out_norm).
        """
        B, W = tokens.shape
        x = linear(embed_weight, self.token_in, norm=self.embed_norm, index=tokens)       # [B, W, r]
        cos, sin = self._node_rope(x.device, x.dtype)                                     # [lookahead+1, hd] each
        P, Nt = state.prefix_len, state.num_nodes
        if mask is None:
            eye = torch.eye(W, dtype=torch.bool, device=x.device).expand(B, W, W)
            mask = torch.cat([visible.new_ones(B, W, P), visible, eye], dim=-1)[:, None]  # [B, 1, W, P+Nt+W]
        elif tuple(mask.shape) != (B, 1, W, P + Nt + W):
            raise ValueError(f"mask must be [{B}, 1, {W}, {P + Nt + W}], got {list(mask.shape)}")
        for i, blk in enumerate(self.blocks):
            if state.capacity is None:
                q, k, v = blk.qkv(x, cos, sin, positions=depths)
                ks, vs = state.append(i, k, v)                                            # [B, nh, P+Nt+W, hd]
            else:                                     # k, v written straight into the static state's slots
                q, _, _ = blk.qkv(x, cos, sin, depths, *state.slots(i, W))
                ks, vs = state.keys(i, W)                                                 # [B, nh, P+Nt+W, hd]
            x = blk.finish(x, q, ks, vs, mask)
        state.advance(W)
        assert state.num_nodes == Nt + W
        return x

    def score(self, h: torch.Tensor, cand_ids: torch.Tensor, cand_logits: torch.Tensor,
              lm_head_weight: torch.Tensor, scoring: WeaverScoring = WeaverScoring(),
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., r] (the last block's output, before out_norm), cand_ids/cand_logits [..., K] -> log q over the K
        candidates [..., K] (fp32, or fp64).

        Reads only the K candidate rows of the LM head: residual_c = W_lm[c] . (A out_norm(h)), A = lm_head_query_in
        (the norm and A: one launch of `linear` in CUDA inference over a few rows).
        On CUDA (fp16/bf16/fp32) the Triton kernels of `tfm_kernels.candidate_logits` gather the rows in both passes
        instead of materialising W_lm[cand] ([..., K, d_model]: 78.6 MB per training row at the Qwen3.6-27B preset);
        `scoring` picks how. `rows` (inference, no gradient): long [...] (h's leading shape), each query's row of
        cand_ids/cand_logits given as tables [R, K]; the kernels read those rows in place of a gather.
        """
        query = linear(h, self.lm_head_query_in, norm=self.out_norm)                     # [..., d_model]
        # the kernels treat the LM head as frozen: so it is unless a gradient to it is wanted (inference under
        # no_grad passes the target's, a parameter that requires one, as it is)
        frozen = not (torch.is_grad_enabled() and lm_head_weight.requires_grad)
        kernels = scoring.kernels and kernel_device(query) and query.dtype != torch.float64 and frozen
        if kernels:
            lm_head_weight = lm_head_weight.detach()
        K = cand_ids.shape[-1]
        if rows is not None:
            if h.requires_grad or tuple(rows.shape) != tuple(h.shape[:-1]) or cand_ids.dim() != 2:
                raise ValueError(f"score with rows: h [..., r] without gradient, rows [...] = {list(h.shape[:-1])} "
                                 f"and tables [R, K], got rows {list(rows.shape)}, cand_ids {list(cand_ids.shape)}")
            if kernels:
                from tfm_kernels.candidate_logits import candidate_logits
                _, logq = candidate_logits(query.reshape(-1, query.shape[-1]), lm_head_weight, cand_ids,
                                           bias=cand_logits.float(), rows=rows.reshape(-1))   # [M, K] fp32
                return logq.view(*rows.shape, K)
            cand_ids, cand_logits = cand_ids[rows], cand_logits[rows]                    # [..., K] each
        if kernels:
            from tfm_kernels.candidate_logits import candidate_log_probs
            hid, cand, bias = query.reshape(-1, query.shape[-1]), cand_ids.reshape(-1, K), cand_logits.reshape(-1, K)
            if scoring.group_rows > 0 and cand_ids.dim() >= 3:
                from tfm_kernels.candidate_logits.grouped import grouped_candidate_log_probs
                group = scoring.group_rows * cand_ids.shape[-2]                          # rows x L queries
                logq = grouped_candidate_log_probs(hid, lm_head_weight, cand, group, bias=bias.float(),
                                                   tuning=scoring.tuning)
            else:
                logq = candidate_log_probs(hid, lm_head_weight, cand, bias=bias.float())  # [M, K] fp32
            return logq.view(cand_ids.shape)
        w = lm_head_weight[cand_ids]                                                     # [..., K, d_model]
        residual = (w @ query.unsqueeze(-1)).squeeze(-1)                                 # [..., K]
        dt = torch.promote_types(residual.dtype, torch.float32)                          # fp32 or fp64
        return torch.log_softmax(cand_logits.to(dt) + residual.to(dt), dim=-1)

    # ---- training: teacher-forced chains, one pass ---------------------------------------------------
    def forward_chain(self, h_final: torch.Tensor, u: torch.Tensor, chain_tokens: torch.Tensor,
                      cand_ids: torch.Tensor, cand_logits: torch.Tensor, embed_weight: torch.Tensor,
                      lm_head_weight: torch.Tensor, scoring: WeaverScoring = WeaverScoring()) -> torch.Tensor:
        """Batched teacher forcing along the true continuation.

        h_final [B, H]; u [B, L, H]; chain_tokens [B, L] = (root, x_1, ..., x_{L-1}); cand_ids/logits [B, L, K].
        Node d (token chain_tokens[:, d], depth d) sees the whole prefix and chain nodes 0..d and scores the
        candidates of depth d+1 (row d) as `score` does with `scoring`. Returns log q [B, L, K].
        """
        B, L = chain_tokens.shape
        dev = h_final.device
        pos = torch.cat([torch.arange(L + 1, device=dev), torch.arange(1, L + 1, device=dev)])
        cos, sin = self._rope(pos, self.proposal_in.weight.dtype)       # first: its graph break leads the graph
        p = self.proposal_in(self.output_norm(torch.cat([h_final[:, None], u], dim=1)))  # [B, 1+L, r]
        n = self.token_in(self.embed_norm(F.embedding(chain_tokens, embed_weight)))      # [B, L, r]
        x = torch.cat([p, n], dim=1)                                                     # [B, 1+2L, r]
        mask = chain_mask(L, dev)
        for blk in self.blocks:
            q, k, v = blk.qkv(x, cos, sin)
            x = blk.finish(x, q, k, v, mask[None, None])
        return self.score(x[:, L + 1:], cand_ids, cand_logits, lm_head_weight, scoring)

    # ---- artifact: config.json + model.safetensors ---------------------------------------------------
    def save_pretrained(self, path: str, extra_config: dict | None = None) -> None:
        save_safetensors_dir(path, {**self.cfg.to_dict(), **(extra_config or {})}, self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype | None = None, device=None) -> "Weaver":
        config, state = load_safetensors_dir(path)
        model = cls(WeaverConfig.from_dict(config))
        load_strict(model, state, f"Weaver at {path}")
        return model.to(device=device, dtype=dtype)
