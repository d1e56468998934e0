"""StaticDFlash: DFlash drafting on a static context cache, each call shape-static so it can be a CUDA graph.

The reference drafter (`tfm_runtime.models.dflash.DFlashDrafter`) grows its context K/V by concatenation. Here the
context K/V of every layer lives in one preallocated buffer whose slot j holds position j, and the committed
context length is a device tensor, so nothing in a round depends on a host value:

    prefill(taps [T, F])        eager: the prompt's context K/V into slots 0..T-1; length = T
    extend(taps [n, F])         n <= S rows, padded to S: their K/V into slots length..length+S-1; length += n
    draft(bonus [1])            the block [bonus, MASK x L] at positions length..length+L: its K/V into slots
                                length..length+L, every query attending to slots < length + S
                                -> (logits [L, V], hidden [L, H]) of block positions 1..L

Slots at or past `length` hold stale K/V from padding rows or an earlier block: `draft` overwrites the ones its
queries can see before reading them, so the outputs equal the reference drafter's up to the order of float sums
(the reference attends to the concatenated keys without a mask). F = n_taps * H, S = block size, L = S - 1.

Each layer's q, k, v projections run as one GEMM, and its MLP's gate and up as one: the drafter's modules are first
given one tensor per group (`fast.dense.rehome_model`; they keep working on views of it). In CUDA inference, for
drafters whose weights `tfm_kernels.small_linear` is for (launch-bound ones), each of the draft's projections is one
launch with the norm before it (input, MLP) or the swiglu and residual add after it fused in.
With `cuda_graphs` on CUDA, `extend` and `draft` replay graphs captured at construction; their outputs are static
tensors, valid until the next call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tfm_runtime.fast import dense
from tfm_runtime.fast.dense import fused_rows, rehome_model, rope_into_cache
from tfm_runtime.models.common import rope_cos_sin, silu_mul, small_linear_ok
from tfm_runtime.models.dflash import DFlashDrafter


class StaticDFlash:
    """`drafter` with context slots for `max_len` committed positions (plus one block), on the drafter's device.

    embed_weight [V, H] and lm_head_weight [V, H] are the target's (DFlash has neither of its own).
    """

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 max_len: int, cuda_graphs: bool = False):
        cfg = drafter.cfg
        p = next(drafter.parameters())
        self.drafter, self.cfg, self.device, self.dtype = drafter, cfg, p.device, p.dtype
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        # per layer: q/k/v weight [(nh + 2 Hkv) D, H] and bias (or None), gate/up weight [2 I, H] and bias
        rehome_model(drafter)
        self.fused = []
        for layer in drafter.layers:
            a, m = layer.self_attn, layer.mlp
            self.fused.append((fused_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                               fused_rows([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                               fused_rows([m.gate_proj.weight, m.up_proj.weight]),
                               fused_rows([m.gate_proj.bias, m.up_proj.bias])))
        self.S = cfg.block_size
        self.slots = max_len + self.S
        dev, S = self.device, self.S
        shape = (len(drafter.layers), 1, cfg.num_key_value_heads, self.slots, cfg.head_dim)
        self.k = torch.zeros(shape, device=dev, dtype=self.dtype)           # [layers, 1, Hkv, slots, D]
        self.v = torch.zeros(shape, device=dev, dtype=self.dtype)           # [layers, 1, Hkv, slots, D]
        self.length = torch.zeros(1, device=dev, dtype=torch.long)          # [1] committed context positions
        self.count = torch.zeros(1, device=dev, dtype=torch.long)           # [1] real rows of taps_in
        self.taps_in = torch.zeros(S, len(cfg.target_layer_ids) * cfg.hidden_size, device=dev,
                                   dtype=self.dtype)                        # [S, F]
        self.block = torch.full((S,), cfg.mask_token_id, device=dev, dtype=torch.long)   # [S] bonus, MASK...
        self.ar_block = torch.arange(S, device=dev)                         # [S]
        self.ar_slots = torch.arange(self.slots, device=dev)                # [slots]
        self.cos, self.sin = rope_cos_sin(self.ar_slots, cfg.head_dim, cfg.rope_theta, self.dtype)  # [slots, D]
        self.graphs: dict[str, tuple] = {}                                  # name -> (graph, outputs)
        if cuda_graphs and dev.type == "cuda":
            self._capture()

    # ---- public ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, taps: torch.Tensor) -> None:
        """taps [T, F] of positions 0..T-1 (T <= max_len): a new request's context."""
        T = taps.shape[0]
        if not 0 < T <= self.slots - self.S:
            raise ValueError(f"a context of {T} positions does not fit {self.slots - self.S} slots")
        self._write(taps.to(self.dtype), torch.arange(T, device=self.device))
        self.length.fill_(T)

    @torch.no_grad()
    def extend(self, taps: torch.Tensor) -> None:
        """taps [n, F], 1 <= n <= S: the next committed positions' features."""
        n = taps.shape[0]
        if not 0 < n <= self.S:
            raise ValueError(f"extend takes 1..{self.S} positions, got {n}")
        self.taps_in[:n].copy_(taps)
        self.count.fill_(n)
        if "extend" in self.graphs:
            self.graphs["extend"][0].replay()
        else:
            self._extend()

    @torch.no_grad()
    def draft(self, bonus: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """bonus [1] long (None: already in `block[0]`, written by the caller's graph) -> (logits [L, V],
        hidden [L, H]) for block positions 1..L."""
        if bonus is not None:
            self.block[:1].copy_(bonus)
        if "draft" in self.graphs:
            graph, out = self.graphs["draft"]
            graph.replay()
            return out
        return self._draft()

    # ---- shape-static bodies -----------------------------------------------------------------------
    def _write(self, taps: torch.Tensor, slots: torch.Tensor) -> None:
        """Context K/V of taps [n, F] at positions = slots [n], into those slots of every layer."""
        ctx = self.drafter.hidden_norm(self.drafter.fc(taps))                              # [n, H]
        for i, layer in enumerate(self.drafter.layers):
            _, k, v, norms = self._qkv(i, ctx, query=False)                                # [n, Hkv, D]
            rope_into_cache(None, k, v, self.cos, self.sin, slots, slots, self.k[i, 0], self.v[i, 0], *norms)

    def _qkv(self, i: int, h: torch.Tensor, query: bool = True, norm=None):
        """Layer i: h [T, H] -> q [T, nh, D] (None without `query`), k [T, Hkv, D], v [T, Hkv, D], not yet rotated,
        and the q / k norms still to apply ((q weight, k weight, eps) where `rope_into_cache` takes its kernel, which
        applies them in its launch; else () and the norm modules applied here). norm: an RMSNorm applied to h first,
        in the projection's launch (`small_linear`)."""
        cfg, att = self.cfg, self.drafter.layers[i].self_attn
        T, hd, nh, nkv = h.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        w, b = self.fused[i][:2]
        if norm is not None:
            from tfm_kernels.small_linear import small_linear
            qkv = small_linear(h, w, b, norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps)
        else:
            qkv = F.linear(h, w, b)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)                          # [T, .] views
        q, k, v = (q.view(T, nh, hd) if query else None), k.view(T, nkv, hd), v.view(T, nkv, hd)
        qn, kn = att.q_norm, att.k_norm
        if qn.bias is None and kn.bias is None and qn.eps == kn.eps and dense.inference_kernel_ok(k, qn.weight,
                                                                                                  kn.weight):
            return q, k, v, (qn.weight, kn.weight, kn.eps)                 # rope_into_cache's kernel applies them
        return (qn(q) if query else None), kn(k), v, ()

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's SwiGLU MLP, gate and up from one GEMM: h [..., H] -> [..., H]."""
        w, b = self.fused[i][2:]
        gate, up = F.linear(h, w, b).chunk(2, dim=-1)                                       # [..., I] views
        down = self.drafter.layers[i].mlp.down_proj
        return F.linear(silu_mul(gate, up), down.weight, down.bias)

    def _extend(self) -> None:
        self._write(self.taps_in, self.length + self.ar_block)
        self.length += self.count

    def _draft(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, S = self.cfg, self.S
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        pos = self.length + self.ar_block                                                  # [S] slots = positions
        seen = self.ar_slots[None, :] < (self.length + S)                                  # [1, slots]
        layers = self.drafter.layers
        x = F.embedding(self.block, self.embed_weight)[None]                               # [1, S, H]
        # small: each projection one `small_linear` launch with the norm before it or the swiglu and residual add
        # after it (the layers share their shapes: the first one decides)
        l0, (wqkv, bqkv, wgu, bgu) = layers[0], self.fused[0]
        small = small_linear_ok(x, S, (wqkv, l0.self_attn.o_proj.weight, wgu, l0.mlp.down_proj.weight), bqkv,
                                l0.self_attn.o_proj.bias, bgu, l0.mlp.down_proj.bias, l0.input_layernorm.weight,
                                l0.post_attention_layernorm.weight)
        h = None if small else layers[0].input_layernorm(x)                                # [1, S, H]
        for i, layer in enumerate(layers):
            att = layer.self_attn
            q, k, v, norms = self._qkv(i, x[0], norm=layer.input_layernorm) if small else self._qkv(i, h[0])
            q, _ = rope_into_cache(q, k, v, self.cos, self.sin, pos, pos, self.k[i, 0], self.v[i, 0], *norms)
            q = q.transpose(0, 1)[None]                                                    # [1, nh, S, D]
            mask = seen
            if att.sliding and cfg.sliding_window:
                mask = seen & (self.ar_slots[None, :] > pos[:, None] - cfg.sliding_window)   # [S, slots]
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=hd ** -0.5,
                                               enable_gqa=True)                            # [1, nh, S, D]
            o = o.transpose(1, 2).reshape(1, S, nh * hd)                                   # [1, S, nh D]
            if small:
                from tfm_kernels.small_linear import small_linear
                pn, down, (w, b) = layer.post_attention_layernorm, layer.mlp.down_proj, self.fused[i][2:]
                x = small_linear(o, att.o_proj.weight, att.o_proj.bias, residual=x)          # [1, S, H]
                g = small_linear(x, w, b, norm_weight=pn.weight, norm_bias=pn.bias, eps=pn.eps, swiglu=True,
                                 silu_rounded=True)                                        # [1, S, I]
                x = small_linear(g, down.weight, down.bias, residual=x)
                continue
            # each residual add with the norm after it (in CUDA inference one launch each, the same roundings)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.drafter.norm
            x, h = layer.post_attention_layernorm.add(x, att.o_proj(o))
            x, h = nxt.add(x, self._mlp(i, h))
        hidden = (self.drafter.norm(x) if small else h)[0, 1:]                             # [L, H] final norm
        return hidden @ self.lm_head_weight.T, hidden

    def _capture(self) -> None:
        """Graphs of `_extend` and `_draft`. Warm-up runs write slots 0..2S-1 and capture leaves `length` as it
        was; both are reset by the next `prefill`."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):                   # compile kernels and fill the allocator before capture
            for _ in range(2):
                self._extend()
                self._draft()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for name, body in (("extend", self._extend), ("draft", self._draft)):
            length = self.length.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = body()
            self.length.copy_(length)
            self.graphs[name] = (graph, out)
        self.length.zero_()
