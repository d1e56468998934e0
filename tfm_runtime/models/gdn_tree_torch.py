"""Tree forward of one Hugging Face Gated DeltaNet layer (Qwen3-Next, Qwen3.5), read-only on the committed state.

Per node i (parents before children, node 0 = root, its parent is the committed state):
  conv:  window = pre-conv inputs of its (Kc-1) nearest ancestors and itself, falling back to the committed conv
         state above the root; out = silu(sum_j w_j * window_j)
  GDN:   S_i = exp(g_i) (I - b_i k_i k_i^T) S_parent + b_i k_i v_i^T  (HF layout: S [K, V]),  o_i = S_i^T q_i
The committed conv/recurrent states are never written here; `TreeGDNStash` keeps what the commit needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TreeGDNStash:
    ext: torch.Tensor          # [B, Kc + N, C]  committed conv inputs followed by the nodes' pre-conv inputs
    win: torch.Tensor          # [N, Kc] long    rows of `ext` forming each node's conv window (oldest first)
    states: torch.Tensor       # [B, N, HV, K, V] recurrent state after each node (torch backend)

    def conv_window(self, leaf: int) -> torch.Tensor:
        """The committed conv state after accepting `leaf`: [B, C, Kc]."""
        return self.ext[:, self.win[leaf]].transpose(1, 2)

    def commit_into(self, layer, leaf: int) -> None:
        """Write the accepted leaf's recurrent state and conv window into an HF linear-attention cache layer."""
        layer.recurrent_states[0].copy_(self.states[:, leaf].to(layer.recurrent_states[0].dtype))
        layer.conv_states[0].copy_(self.conv_window(leaf).to(layer.conv_states[0].dtype))


@dataclass
class TritonTreeGDNStash:
    mixed: torch.Tensor        # [B, N, C] pre-conv inputs of the nodes
    parents: torch.Tensor      # [B, N] int32
    gdn: object                # tfm_kernels.gdn_tree.GDNTreeStash

    def commit_into(self, layer, leaf: int) -> None:
        from tfm_kernels.gdn_tree import tree_conv1d_commit, tree_gdn_commit
        B = self.mixed.shape[0]
        slots = torch.arange(B, dtype=torch.int32, device=self.mixed.device)
        leaves = torch.full((B,), leaf, dtype=torch.int32, device=self.mixed.device)
        tree_gdn_commit(layer.recurrent_states[0], slots, leaves, self.gdn)
        tree_conv1d_commit(self.mixed, layer.conv_states[0], leaves, self.parents, slots)


def conv_window_index(parents: torch.Tensor, kc: int) -> torch.Tensor:
    """parents [N] -> [N, Kc] indices into ext = [conv_state (Kc rows) | nodes (N rows)], oldest first."""
    parents = parents.tolist()
    rows = []
    for i in range(len(parents)):
        chain, cur = [], i
        while cur >= 0 and len(chain) < kc:
            chain.append(kc + cur)
            cur = parents[cur]
        steps_above = 0
        while len(chain) < kc:                 # above the root: the committed conv state, newest first
            chain.append(kc - 1 - steps_above)
            steps_above += 1
        rows.append(chain[::-1])
    return torch.tensor(rows, dtype=torch.long)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _project(mod, x: torch.Tensor):
    """x [B, N, H] -> mixed_qkv [B, N, C], z [B, N, HV, Dv], b, a [B, N, HV] for either HF GDN flavour."""
    B, N, _ = x.shape
    if hasattr(mod, "in_proj_qkvz"):                          # Qwen3-Next: interleaved per key head
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
        mixed = torch.cat([t.reshape(B, N, -1) for t in (q, k, v)], dim=-1)
        return mixed, z, b, a
    if hasattr(mod, "in_proj_qkv"):                           # Qwen3.5: separate projections
        z = mod.in_proj_z(x).reshape(B, N, -1, mod.head_v_dim)
        return mod.in_proj_qkv(x), z, mod.in_proj_b(x), mod.in_proj_a(x)
    raise TypeError(f"unsupported Gated DeltaNet layer {type(mod).__name__}")


def tree_recurrence(q, k, v, g, beta, parents, S0):
    """Reference node-by-node tree recurrence (q, k already normalised and scaled).

    q, k [B, N, HV, K]; v [B, N, HV, V]; g, beta [B, N, HV]; parents [N]; S0 [B, HV, K, V] (read only)
    -> o [B, N, HV, V], states [B, N, HV, K, V].
    """
    B, N, HV, Kd = k.shape
    states = S0.new_empty(B, N, HV, Kd, v.shape[-1])
    o = v.new_empty(v.shape)
    for i, p in enumerate(parents.tolist()):
        S = (S0 if p < 0 else states[:, p]) * g[:, i].exp()[..., None, None]
        delta = beta[:, i, :, None] * (v[:, i] - (S * k[:, i, :, :, None]).sum(-2))     # [B, HV, V]
        S = S + k[:, i, :, :, None] * delta[:, :, None, :]
        states[:, i] = S
        o[:, i] = (S * q[:, i, :, :, None]).sum(-2)
    return o, states


def gdn_tree_layer_forward(mod, hidden_states: torch.Tensor, cache, parents: torch.Tensor, backend: str = "torch",
                           anc_bits: torch.Tensor | None = None, single_root: bool = False):
    """hidden_states [B, N, H] of the tree nodes -> (layer output [B, N, H], stash with `commit_into`).

    `anc_bits` [B, N, ceil(N/32)] int32 (triton backend): the ancestor bitmask built once per step for all layers;
    `single_root`: node 0 is every node's ancestor (lets the kernel fold it into the state, see tree_gdn_verify).
    """
    B, N, _ = hidden_states.shape
    li, kc = mod.layer_idx, mod.conv_kernel_size
    mixed, z, b, a = _project(mod, hidden_states)                                    # mixed [B, N, C]
    conv_state = cache.get_conv_state(li, state_idx=0)                               # [B, C, Kc] or None
    S0 = cache.get_recurrent_state(li, state_idx=0)                                  # [B, HV, K, V] or None
    if conv_state is None or S0 is None:
        raise RuntimeError(f"GDN layer {li}: tree verification needs a prefilled cache (run the prompt first)")
    if backend == "triton":
        return _triton_forward(mod, mixed, z, b, a, conv_state, S0, parents, anc_bits, single_root)
    if backend != "torch":
        raise ValueError(f"GDN tree backend must be 'torch' or 'triton', got {backend!r}")
    ext = torch.cat([conv_state.transpose(1, 2).to(mixed.dtype), mixed], dim=1)      # [B, Kc+N, C]
    win = conv_window_index(parents.cpu(), kc).to(mixed.device)                      # [N, Kc]
    w = mod.conv1d.weight.squeeze(1)                                                 # [C, Kc]
    conv = torch.einsum("bnkc,ck->bnc", ext[:, win], w)
    if mod.conv1d.bias is not None:
        conv = conv + mod.conv1d.bias
    conv = F.silu(conv)
    q, k, v = torch.split(conv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(B, N, -1, mod.head_k_dim)
    k = k.reshape(B, N, -1, mod.head_k_dim)
    v = v.reshape(B, N, -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    cdt = torch.float64 if mixed.dtype == torch.float64 else torch.float32
    rep = mod.num_v_heads // mod.num_k_heads
    q, k = (_l2norm(t.to(cdt)).repeat_interleave(rep, dim=2) for t in (q, k))
    q = q * mod.head_k_dim ** -0.5
    o, states = tree_recurrence(q, k, v.to(cdt), g.to(cdt), beta.to(cdt), parents, S0.to(cdt))
    o = o.to(hidden_states.dtype)
    out = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim)).reshape(B, N, -1)
    return mod.out_proj(out), TreeGDNStash(ext=ext, win=win, states=states)


def _triton_forward(mod, mixed, z, b, a, conv_state, S0, parents, anc_bits, single_root=False):
    """The same layer through tfm_kernels.gdn_tree: tree conv + masked triangular solve, committed state read-only."""
    from tfm_kernels.gdn_tree import tree_conv1d, tree_gdn_verify
    if mixed.dtype == torch.float64:
        raise TypeError("the triton GDN tree backend takes fp32/fp16/bf16 targets; use backend='torch' for fp64")
    B, N, _ = mixed.shape
    dev = mixed.device
    assert anc_bits is None or anc_bits.shape[0] == B, "one ancestor bitmask per request"
    par = parents.to(device=dev, dtype=torch.int32)[None].expand(B, N).contiguous()      # [B, N]
    n = torch.full((B,), N, dtype=torch.int32, device=dev)
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    conv = tree_conv1d(mixed, conv_state, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, par, n, slots)
    q, k, v = torch.split(conv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(B, N, -1, mod.head_k_dim)
    k = k.reshape(B, N, -1, mod.head_k_dim)
    v = v.reshape(B, N, -1, mod.head_v_dim)
    beta = b.sigmoid().float()
    g = (-mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)).float()
    precision = "ieee" if mixed.dtype == torch.float32 else "tf32"
    o, stash = tree_gdn_verify(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                               par, n, S0, slots, scale=mod.head_k_dim ** -0.5, use_qk_l2norm=True,
                               anc=anc_bits, check=False, precision=precision, single_root=single_root)
    out = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim)).reshape(B, N, -1)
    return mod.out_proj(out), TritonTreeGDNStash(mixed=mixed, parents=par, gdn=stash)
