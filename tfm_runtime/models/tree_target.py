"""Verify a whole proposal tree in one target pass over a Hugging Face KV cache, then commit the accepted path.

Full-attention layers: the tree's keys/values are appended to the cache and masked to "committed prefix +
ancestor-or-self" (positions = committed length + depth); the commit keeps the accepted nodes' K/V only.
Gated DeltaNet layers (hybrid targets): the layer's forward is swapped for a tree forward during the pass: the
short conv runs along ancestors and the recurrence starts from the committed state, which is only read; the
commit then writes the accepted leaf's recurrent state and the last conv inputs of the accepted path.
"""
from __future__ import annotations

import types

import torch

from tfm_runtime.models.gdn_tree_torch import gdn_tree_layer_forward
from tfm_runtime.models.target import TargetModel, TargetOutput


TREE_ATTENTION = ("eager", "sdpa")       # attention implementations that apply a custom 4-D additive mask as given


def unsupported_reason(target: TargetModel) -> str | None:
    """None when tree verification can run `target`, else why not. The tree pass hands every attention layer one
    4-D additive mask (committed prefix + ancestors) over a cache that keeps every position: implementations that
    build their own masks (flash, flex, paged, kernels) would ignore it, and sliding-window layers would need a
    windowed mask over a cache that drops old positions."""
    cfg = target.config
    impl = cfg._attn_implementation
    if impl not in TREE_ATTENTION:
        return (f"its attention implementation {impl!r} does not apply the tree's 4-D mask; load the target with "
                f"attn_implementation='eager' or 'sdpa'")
    types = target.layer_types
    other = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
    if other:
        layers = [i for i, t in enumerate(types) if t in other]
        return f"layers {layers} are {', '.join(map(repr, other))}, which tree verification does not support"
    if not getattr(cfg, "layer_types", None) and getattr(cfg, "sliding_window", None):
        return f"every layer attends through a sliding window of {cfg.sliding_window} tokens"
    windowed = [i for i, layer in enumerate(target.base.layers)
                if getattr(getattr(layer, "self_attn", None), "sliding_window", None)]
    if windowed:
        return f"layers {windowed} attend through a sliding window, which tree verification does not support"
    return None


def _gdn_modules(target: TargetModel) -> dict[int, torch.nn.Module]:
    out = {}
    for i, layer in enumerate(target.base.layers):
        mod = getattr(layer, "linear_attn", None)
        if mod is not None:
            out[i] = mod
    return out


class TreeVerifier:
    """Tree verification and commit for one request (batch 1) against a `TargetModel` and its HF cache.

    `backend`: "torch" (node-by-node reference recurrence) or "triton" (tfm_kernels.gdn_tree; CUDA only), or "auto".
    """

    def __init__(self, target: TargetModel, backend: str = "auto"):
        reason = unsupported_reason(target)
        if reason:
            raise ValueError(f"tree verification cannot run {type(target.model).__name__}: {reason}")
        self.target = target
        self.gdn = _gdn_modules(target)
        if backend == "auto":
            backend = "triton" if target.device.type == "cuda" and target.dtype != torch.float64 else "torch"
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.backend = backend
        self._ctx = None          # set during a tree pass: dict(parents=..., stash={layer: ...})
        for mod in self.gdn.values():
            if not hasattr(mod, "_tfm_plain_forward"):
                mod._tfm_plain_forward = mod.forward
            mod.forward = types.MethodType(self._make_gdn_forward(), mod)

    def _make_gdn_forward(self):
        verifier = self

        def forward(mod, hidden_states, *args, **kwargs):
            ctx = verifier._ctx
            if ctx is None:
                return mod._tfm_plain_forward(hidden_states, *args, **kwargs)
            cache = kwargs.get("cache", kwargs.get("cache_params"))   # `cache` since transformers 5.24
            out, stash = gdn_tree_layer_forward(mod, hidden_states, cache, ctx["parents"], backend=verifier.backend,
                                                anc_bits=ctx["anc_bits"], single_root=ctx["single_root"])
            ctx["stash"][mod.layer_idx] = stash
            return out
        return forward

    def verify(self, cache, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               ancestor_mask: torch.Tensor, start: int) -> TargetOutput:
        """tokens/parents/depths [N], ancestor_mask [N, N] bool (inclusive), start = committed length.

        Returns the target outputs at every node ([1, N, ...]); the cache now also holds the N tree entries of the
        attention layers (until `commit`). GDN committed states are untouched.
        """
        N = tokens.shape[0]
        dev, dt = self.target.device, self.target.dtype
        visible = torch.cat([torch.ones(N, start, dtype=torch.bool, device=dev), ancestor_mask.to(dev)], dim=1)
        mask = torch.zeros(N, start + N, dtype=dt, device=dev).masked_fill(~visible, torch.finfo(dt).min)
        mask = mask[None, None]                                                     # [1, 1, N, start+N]
        if self.target.is_hybrid:
            mask = {"full_attention": mask, "linear_attention": None}
        anc_bits, single_root = None, False
        if self.backend == "triton" and self.gdn:
            from tfm_kernels.gdn_tree import check_parents, tree_ancestor_bits   # once per step, for every GDN layer
            par = parents.to(device=dev, dtype=torch.int32)[None]
            n = torch.full((1,), N, dtype=torch.int32, device=dev)
            single_root = check_parents(par, n)                  # (on the host)
            anc_bits = tree_ancestor_bits(par, n, check=False)
        self._ctx = {"parents": parents.to(dev), "stash": {}, "anc_bits": anc_bits, "single_root": single_root}
        try:
            out = self.target(tokens[None].to(dev), position_ids=(start + depths)[None].to(dev),
                              attention_mask=mask, cache=cache, use_cache=True)
        finally:
            self._stash, self._ctx = self._ctx["stash"], None
        return out

    def commit(self, cache, start: int, accepted: list[int]) -> None:
        """Keep the accepted nodes (root first, in path order) as committed positions start..start+len-1."""
        idx = torch.as_tensor(accepted, dtype=torch.long, device=self.target.device)
        for i, layer in enumerate(cache.layers):
            if i in self.gdn:
                self._stash[i].commit_into(layer, accepted[-1])
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                keep = torch.cat([torch.arange(start, device=idx.device), start + idx])
                layer.keys = layer.keys.index_select(2, keep)
                layer.values = layer.values.index_select(2, keep)
        self._stash = None
