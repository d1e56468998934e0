"""Compact hybrid target (Qwen3-Next, Qwen3.5 text) with a static KV cache and a GDN state pool, one request at a time.

Layers are either gated full attention or Gated DeltaNet (GDN), as Hugging Face's modeling code computes them:
  attention  q_proj gives q and an output gate per head; q/k RMSNorm (weight 1 + w) per head; partial RoPE on the
             first `rotary_dim` channels; softmax attention; out = o_proj(attn * sigmoid(gate))
  GDN        mixed qkv (and z, b, a) from the input projections (Qwen3.5: one GEMM, four column views of its
             output, read in place); causal depthwise short conv (SiLU) on mixed qkv;
             beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); q, k L2-normalised, q scaled by K^-1/2,
             q/k heads repeated to the value heads; S = e^g (I - beta k k^T) S + beta k v^T, o = S^T q;
             out = out_proj(RMSNorm(o) * w * silu(z))
  MLP        SwiGLU, or (Qwen3-Next) a top-k MoE with a sigmoid-gated shared expert
RMSNorms outside the GDN output norm use weight 1 + w. Qwen3.5's multimodal RoPE equals plain RoPE for text
positions (all three position axes equal), which is all a decoder feeds it.

State: the attention layers' KV cache [L_attn, Hkv, max_seq_len, D]; per GDN layer a recurrent state [HV, K, V] (fp32)
and a conv state [C, W - 1] (the last W - 1 conv inputs, oldest first), held in pools indexed by GDN layer.
Entry points, as DenseModel's:

    prefill(tokens [T])                  the prompt from an empty state (chunks of chain trees, each committed)
    decode(token [1], pos)               one token at slot / position pos; its GDN states are committed
    verify_tree(tokens [N], depths [N], anc [N, N], start, parents=None)
                                         attention as DenseModel's; each GDN node's state follows from its
                                         parent's (node 0 from the committed state), its conv window runs along its
                                         ancestors; the committed GDN states are only read
    commit(start, accepted [A])          KV compaction as DenseModel's; each GDN layer's recurrent and conv state
                                         set to the accepted leaf's

GDN backends: "torch" (the node-by-node tree recurrence of tfm_runtime.models.gdn_tree_torch, the float64-checked
reference; any dtype) or "triton" (tfm_kernels.gdn_tree: the tree conv and the gates in one launch, the masked
triangular solve, the commit kernels; CUDA, or the CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tfm_kernels.rms_norm import rms_norm as fused_rms_norm
from tfm_runtime.fast.dense import (DenseModel, DenseOutput, add_rms_norm, checked_weight, fused_rows, rms_norm_1p,
                                    rope_into_cache, tree_bits)
from tfm_runtime.models.common import inference_kernel_ok, silu_mul
from tfm_runtime.models.gdn_tree_torch import tree_recurrence

FAMILIES = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5"}       # model_type -> family
LAYER_TYPES = ("full_attention", "linear_attention")
PREFILL_CHUNK = 64                       # prompt tokens per chain tree in prefill


@dataclass
class HybridConfig:
    """What the hybrid forward needs from a Hugging Face config (`from_hf` refuses what it cannot run)."""
    family: str                          # "qwen3_next" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: list
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int                      # RoPE on the first rotary_dim channels of each head
    rope_theta: float
    rms_norm_eps: float
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    num_experts: int = 0                 # MoE (Qwen3-Next): 0 = SwiGLU MLP everywhere
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list = field(default_factory=list)
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config) -> "HybridConfig":
        """A transformers config (or its config.json as a dict) -> HybridConfig; ValueError names what is
        unsupported."""
        if isinstance(config, dict):
            from transformers import AutoConfig
            d = dict(config)
            kind = d.pop("model_type", None)
            _check_type(kind)
            config = AutoConfig.for_model(kind, **d)
        kind = getattr(config, "model_type", None)
        _check_type(kind)
        family = FAMILIES[kind]
        types = list(config.layer_types)
        other = sorted({t for t in types if t not in LAYER_TYPES})
        if other:
            raise ValueError(f"the fast hybrid target runs {LAYER_TYPES} layers; this {kind} config has {other}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"the fast hybrid target needs hidden_act='silu' (SwiGLU, SiLU conv), got "
                             f"{config.hidden_act!r}")
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported by the fast hybrid target")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported by the fast hybrid target "
                             f"(supported: 'default')")
        heads = config.num_attention_heads
        D = getattr(config, "head_dim", None) or config.hidden_size // heads
        rd = int(D * rope.get("partial_rotary_factor", 1.0))
        if rd % 2 or not 0 < rd <= D:
            raise ValueError(f"rotary dim {rd} (head_dim {D} x partial_rotary_factor) must be even and in (0, {D}]")
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hv % hk:
            raise ValueError(f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})")
        if config.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {config.linear_conv_kernel_dim}")
        moe = {}
        experts = getattr(config, "num_experts", 0) or 0
        if family == "qwen3_next" and experts > 0:
            skip, step = set(getattr(config, "mlp_only_layers", None) or []), config.decoder_sparse_step
            moe = dict(num_experts=experts, experts_per_tok=config.num_experts_per_tok,
                       moe_intermediate_size=config.moe_intermediate_size,
                       shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                       norm_topk_prob=bool(config.norm_topk_prob),
                       moe_layers=[i for i in range(config.num_hidden_layers) if i not in skip and (i + 1) % step == 0])
        elif experts > 0:
            raise ValueError(f"{kind} with num_experts={experts}: MoE is supported for qwen3_next only")
        return cls(family=family, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, layer_types=types,
                   num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=D,
                   rotary_dim=rd, rope_theta=float(rope.get("rope_theta", 10000.0)), rms_norm_eps=config.rms_norm_eps,
                   gdn_k_heads=hk, gdn_v_heads=hv, gdn_k_dim=config.linear_key_head_dim,
                   gdn_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), **moe)

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k (K heads of dk) and v (HV heads of dv)."""
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim


def _check_type(kind) -> None:
    if kind not in FAMILIES:
        hint = "; pass the text model (Qwen3_5ForCausalLM, model_type 'qwen3_5_text')" if kind == "qwen3_5" else ""
        raise ValueError(f"the fast hybrid target supports model types {tuple(FAMILIES)}, got {kind!r}{hint}")


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: x, z [..., dv] -> weight * x / rms(x) * silu(z) (HF's RMSNormGated); on CUDA one launch of
    `tfm_kernels.rms_norm` with the same roundings."""
    if inference_kernel_ok(x, z, weight):
        return fused_rms_norm(x, weight, None, eps, gate=z)
    xf = x.float()
    h = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


def tree_parents(anc: torch.Tensor) -> torch.Tensor:
    """anc [N, N] bool inclusive ancestor relation -> parents [N] long (-1 for a root): the latest strict ancestor.
    Static shapes, no host sync."""
    N = anc.shape[0]
    idx = torch.arange(N, device=anc.device)
    strict = anc & (idx[:, None] != idx[None, :])
    return torch.where(strict, idx[None, :], -1).amax(dim=1)


def conv_windows(parents: torch.Tensor, width: int) -> torch.Tensor:
    """parents [N] -> [N, W] rows of ext = [conv state (W - 1 rows, oldest first) | nodes (N rows)] forming each node's
    conv window, oldest first: walking up from the node, a node j is row W - 1 + j and steps above the root continue
    into the state (-1 the newest). Static shapes, no host sync."""
    N, S = parents.shape[0], width - 1
    cur = torch.arange(N, device=parents.device)
    cols = [cur]
    for _ in range(S):
        cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], cur - 1)
        cols.append(cur)
    return S + torch.stack(cols[::-1], dim=1)                                               # [N, W]


@dataclass
class AttnLayer:
    wqkv: torch.Tensor                   # [Hq * 2D + 2 Hkv * D, H]: q and the output gate (interleaved per head),
                                         # then k, then v (`fused_rows`: one GEMM)
    wo: torch.Tensor                     # [H, Hq * D]
    q_norm: torch.Tensor                 # [D]
    k_norm: torch.Tensor                 # [D]


@dataclass
class GDNLayer:
    w_qkvz: torch.Tensor | None          # Qwen3-Next [2 Hk dk + 2 HV dv, H] (grouped per key head)
    w_ba: torch.Tensor | None            # Qwen3-Next [2 HV, H]
    w_in: torch.Tensor | None            # Qwen3.5 [C + HV dv + 2 HV, H]: mixed qkv, z, b, then a rows
                                         # (`fused_rows`: one GEMM)
    conv: torch.Tensor                   # [C, W]
    conv_bias: torch.Tensor | None       # [C]
    A_log: torch.Tensor                  # [HV]
    dt_bias: torch.Tensor                # [HV]
    norm: torch.Tensor                   # [dv]
    w_out: torch.Tensor                  # [H, HV dv]


@dataclass
class MLP:
    w_gate_up: torch.Tensor | None = None   # SwiGLU [2 I, H]: gate, then up rows (`fused_rows`: one GEMM)
    w_down: torch.Tensor | None = None   # [H, I]
    router: torch.Tensor | None = None   # MoE [E, H]
    experts: list | None = None          # E SwiGLU MLPs of Im channels
    shared: "MLP | None" = None          # shared expert (SwiGLU)
    shared_gate: torch.Tensor | None = None   # [1, H]


@dataclass
class Layer:
    kind: str                            # "full_attention" | "linear_attention"
    slot: int                            # index among the layers of its kind (KV cache / GDN pools)
    attn_norm: torch.Tensor              # [H]
    mlp_norm: torch.Tensor               # [H]
    mixer: AttnLayer | GDNLayer
    mlp: MLP


@dataclass
class GDNStash:
    """What the commit of a tree verify needs, per GDN layer (torch backend: states; triton: the kernels' stash)."""
    parents: torch.Tensor                # [N] long (triton: [1, N] int32)
    win: torch.Tensor | None = None      # [N, W] conv windows into ext (torch)
    anc: torch.Tensor | None = None      # [1, N, ceil(N/32)] int32 ancestor bitmask (triton)
    ext: list = field(default_factory=list)      # per GDN layer [W - 1 + N, C]: old conv state, then node inputs
    states: list = field(default_factory=list)   # per GDN layer [N, HV, K, V] (torch)
    mixed: list = field(default_factory=list)    # per GDN layer [1, N, C] conv inputs (triton; a strided view)
    kernel: list = field(default_factory=list)   # per GDN layer tfm_kernels.gdn_tree.GDNTreeStash (triton)


class HybridModel(DenseModel):
    """A Qwen3-Next / Qwen3.5 (text) hybrid target for batch 1 with a static KV cache and a GDN state pool.

    `gdn`: "torch", "triton" (CUDA, or the CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA for fp32/fp16/bf16,
    else torch). `attention` and `tap_layer_ids` as DenseModel's. Build with `HybridModel.from_hf(model, ...)` or
    `HybridModel.from_pretrained(folder, ...)`.
    """

    config_class = HybridConfig

    def __init__(self, cfg: HybridConfig, state: dict[str, torch.Tensor], tap_layer_ids=(), *,
                 max_seq_len: int = 2048, attention: str = "auto", gdn: str = "auto"):
        super().__init__(cfg, state, tap_layer_ids, max_seq_len=max_seq_len, attention=attention)
        dev, dt = self.device, self.dtype
        if gdn == "auto":
            gdn = "triton" if dev.type == "cuda" and dt != torch.float64 else "torch"
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if gdn not in ("torch", "triton") or (gdn == "triton" and dev.type != "cuda" and not interpret):
            raise ValueError(f"gdn must be 'auto', 'torch' or 'triton' (CUDA, or TRITON_INTERPRET=1), got {gdn!r} "
                             f"on {dev}")
        if gdn == "triton" and dt == torch.float64:
            raise ValueError("the triton GDN backend takes fp32/fp16/bf16 targets; use gdn='torch' for float64")
        self.gdn = gdn
        self._stash: GDNStash | None = None

    # ---- weights (from_hf / from_pretrained: DenseModel's, reading the config as a HybridConfig) ----------
    def _load(self, state: dict[str, torch.Tensor]) -> None:
        c = self.cfg
        state = {k.removeprefix("model."): v for k, v in state.items()}
        H, D, nh, nkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        hk, hv, dk, dv, C = c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim, c.conv_dim
        missing = []
        get = functools.partial(checked_weight, state, missing)

        def swiglu(p, inter):
            return MLP(w_gate_up=fused_rows([get(p + "gate_proj.weight", (inter, H)),
                                             get(p + "up_proj.weight", (inter, H))]),
                       w_down=get(p + "down_proj.weight", (H, inter)))

        self.embed = get("embed_tokens.weight", (c.vocab_size, H))                          # [V, H]
        self.norm = get("norm.weight", (H,))                                                # [H]
        self.lm_head = get("lm_head.weight", (c.vocab_size, H), needed=not c.tie_word_embeddings)
        if self.lm_head is None:
            self.lm_head = self.embed                                                       # [V, H]
        self.layers, counts = [], {t: 0 for t in LAYER_TYPES}
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            if kind == "full_attention":
                a = p + "self_attn."
                mixer = AttnLayer(wqkv=fused_rows([get(a + "q_proj.weight", (nh * 2 * D, H)),
                                                   get(a + "k_proj.weight", (nkv * D, H)),
                                                   get(a + "v_proj.weight", (nkv * D, H))]),
                                  wo=get(a + "o_proj.weight", (H, nh * D)),
                                  q_norm=get(a + "q_norm.weight", (D,)), k_norm=get(a + "k_norm.weight", (D,)))
            else:
                g, nx = p + "linear_attn.", c.family == "qwen3_next"
                mixer = GDNLayer(
                    w_qkvz=get(g + "in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, H), nx),
                    w_ba=get(g + "in_proj_ba.weight", (2 * hv, H), nx),
                    w_in=fused_rows([get(g + "in_proj_qkv.weight", (C, H), not nx),
                                     get(g + "in_proj_z.weight", (hv * dv, H), not nx),
                                     get(g + "in_proj_b.weight", (hv, H), not nx),
                                     get(g + "in_proj_a.weight", (hv, H), not nx)]),
                    conv=get(g + "conv1d.weight", (C, 1, c.conv_kernel)), conv_bias=get(g + "conv1d.bias", (C,), False),
                    A_log=get(g + "A_log", (hv,)), dt_bias=get(g + "dt_bias", (hv,)),
                    norm=get(g + "norm.weight", (dv,)),
                    w_out=get(g + "out_proj.weight", (H, hv * dv)))
                if mixer.conv is not None:
                    mixer.conv = mixer.conv.squeeze(1)                                      # [C, W] (a view)
            m = p + "mlp."
            if i in c.moe_layers:
                E, Im = c.num_experts, c.moe_intermediate_size
                if m + "experts.gate_up_proj" in state:         # as transformers holds them: views of 3-D tensors
                    gate_up = get(m + "experts.gate_up_proj", (E, 2 * Im, H))
                    down = get(m + "experts.down_proj", (E, H, Im))
                    experts = [MLP(w_gate_up=gate_up[e], w_down=down[e]) for e in range(E)]
                else:                                          # as checkpoints store them: one MLP per expert
                    experts = [swiglu(f"{m}experts.{e}.", Im) for e in range(E)]
                mlp = MLP(router=get(m + "gate.weight", (E, H)), experts=experts,
                          shared=swiglu(m + "shared_expert.", c.shared_expert_intermediate_size),
                          shared_gate=get(m + "shared_expert_gate.weight", (1, H)))
            else:
                mlp = swiglu(m, c.intermediate_size)
            self.layers.append(Layer(kind, counts[kind], get(p + "input_layernorm.weight", (H,)),
                                     get(p + "post_attention_layernorm.weight", (H,)), mixer, mlp))
            counts[kind] += 1
        if missing:
            raise ValueError(f"{len(missing)} weights missing for this {c.family} config, e.g. {missing[:6]}")
        self.num_attn, self.num_gdn = counts["full_attention"], counts["linear_attention"]

    # ---- static buffers --------------------------------------------------------------------------
    def setup_cache(self, max_seq_len: int) -> None:
        """Allocate the attention layers' KV cache, the RoPE tables for `max_seq_len` slots and the GDN state pools."""
        c, dev, dt = self.cfg, self.embed.device, self.embed.dtype
        rd = c.rotary_dim                                                                   # partial rotary
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))   # [rd/2]
        self._attention_buffers(self.num_attn, max_seq_len, inv_freq)                     # KV [La, Hkv, S, D]
        self.leaf0 = torch.zeros(1, dtype=torch.long, device=dev)
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        gdn = (self.num_gdn, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim)
        self.rec = torch.zeros(gdn, dtype=sdt, device=dev)                                  # [Lg, HV, K, V]
        self.conv = torch.zeros(self.num_gdn, c.conv_dim, c.conv_kernel - 1, dtype=dt, device=dev)   # [Lg, C, W-1]
        self.gdn_slots = torch.arange(self.num_gdn, dtype=torch.int32, device=dev)           # [Lg]

    # ---- forward ---------------------------------------------------------------------------------
    def _attention(self, w: AttnLayer, slot: int, h, pos, slots, attend):
        """Gated attention: h [T, H] -> [T, H] at positions pos [T]; writes K/V of the T tokens into `slots` of the
        layer's cache."""
        c = self.cfg
        T, nh, nkv, D, eps = h.shape[0], c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qg, k, v = F.linear(h, w.wqkv).split([nh * 2 * D, nkv * D, nkv * D], dim=-1)       # [T, .] views
        q, gate = qg.view(T, nh, 2 * D).chunk(2, dim=-1)                                    # [T, Hq, D] each
        k, v = k.view(T, nkv, D), v.view(T, nkv, D)
        q, k = rope_into_cache(q, k, v, self.cos, self.sin, pos, slots, self.k_cache[slot], self.v_cache[slot],
                               w.q_norm, w.k_norm, eps, one_plus=True)                      # the q / k norms too
        o = attend(slot, q, k, v).reshape(T, nh * D)                                         # [T, Hq D]
        return F.linear(o * torch.sigmoid(gate.reshape(T, nh * D)), w.wo)

    def _gdn_inputs(self, w: GDNLayer, h):
        """h [T, H] -> mixed qkv [T, C] (the conv input), z [T, HV, dv], b, a [T, HV]. Qwen3.5: one GEMM, the four
        are column views of its output [T, C + HV dv + 2 HV] (rows C + HV dv + 2 HV apart, last dim contiguous),
        which the conv, gate and norm kernels read in place."""
        c = self.cfg
        T, hk, hv, dk, dv = h.shape[0], c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim
        if w.w_qkvz is not None:                          # Qwen3-Next: [q | k | v | z] and [b | a] per key head
            r = hv // hk
            q, k, v, z = F.linear(h, w.w_qkvz).view(T, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
            b, a = F.linear(h, w.w_ba).view(T, hk, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
            return mixed, z.reshape(T, hv, dv), b.reshape(T, hv), a.reshape(T, hv)
        mixed, z, b, a = F.linear(h, w.w_in).split([c.conv_dim, hv * dv, hv, hv], dim=-1)    # [T, .] views
        return mixed, z.unflatten(-1, (hv, dv)), b, a

    def _gdn(self, w: GDNLayer, slot: int, h, tree: GDNStash):
        """GDN over the tree: h [N, H] -> [N, H]; reads the committed states of pool slot `slot`, writes nothing but
        `tree` (what the commit needs)."""
        c = self.cfg
        N, hk, hv, dk, dv = h.shape[0], c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim
        mixed, z, b, a = self._gdn_inputs(w, h)                                             # mixed [N, C]
        if self.gdn == "triton":
            o = self._gdn_triton(w, slot, mixed, b, a, tree)                                # [N, HV, dv]
        else:
            ext = torch.cat([self.conv[slot].transpose(0, 1), mixed], dim=0)                # [W-1+N, C]
            x = torch.einsum("nwc,cw->nc", ext[tree.win], w.conv)                           # [N, C]
            if w.conv_bias is not None:
                x = x + w.conv_bias
            q, k, v = F.silu(x).split([hk * dk, hk * dk, hv * dv], dim=-1)
            cdt = self.rec.dtype
            beta = b.sigmoid().to(cdt)                                                      # [N, HV]
            g = (-w.A_log.float().exp() * F.softplus(a.float() + w.dt_bias)).to(cdt)       # [N, HV]
            q, k = (t.reshape(N, hk, dk).to(cdt) for t in (q, k))
            q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
            q, k = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))                   # [N, HV, K]
            q = q * dk ** -0.5
            o, states = tree_recurrence(q[None], k[None], v.reshape(1, N, hv, dv).to(cdt), g[None], beta[None],
                                        tree.parents, self.rec[slot][None])                 # [1, N, HV, V]
            o = o[0].to(h.dtype)
            tree.ext.append(ext)
            tree.states.append(states[0])                                                   # [N, HV, K, V]
        o = gated_rms_norm(o, z, w.norm, c.rms_norm_eps).reshape(N, hv * dv)
        return F.linear(o, w.w_out)

    def _gdn_triton(self, w: GDNLayer, slot: int, mixed, b, a, tree: GDNStash):
        """The GDN layer through tfm_kernels.gdn_tree: the tree short conv and the gates in one launch, then the
        tree verify (prep + solve); the pools are only read. mixed [N, C], b, a [N, HV] -> o [N, HV, dv]."""
        from tfm_kernels.gdn_tree import tree_gdn_verify
        from tfm_kernels.gdn_tree.inputs import tree_gdn_inputs
        c = self.cfg
        N, hk, hv, dk, dv = mixed.shape[0], c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim
        idx = self.gdn_slots[slot:slot + 1]                                                 # [1] int32
        n = torch.full((1,), N, dtype=torch.int32, device=mixed.device)
        # x [1, N, C]; g, beta [1, N, HV] fp32
        x, g, beta = tree_gdn_inputs(mixed[None], self.conv, w.conv, w.conv_bias, tree.parents, n, idx, a[None],
                                     b[None], w.A_log, w.dt_bias)
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        precision = "ieee" if mixed.dtype == torch.float32 else "tf32"
        o, kst = tree_gdn_verify(q.reshape(1, N, hk, dk), k.reshape(1, N, hk, dk), v.reshape(1, N, hv, dv), g, beta,
                                 tree.parents, n, self.rec, idx, scale=dk ** -0.5, use_qk_l2norm=True,
                                 anc=tree.anc, check=False, precision=precision, single_root=True)
        tree.mixed.append(mixed[None])
        tree.kernel.append(kst)
        return o[0]

    def _mlp(self, m: MLP, h):
        """SwiGLU, or top-k MoE + sigmoid-gated shared expert (as HF's eager experts): h [T, H] -> [T, H]."""
        if m.router is None:
            gate, up = F.linear(h, m.w_gate_up).chunk(2, dim=-1)                            # [T, I] views
            return F.linear(silu_mul(gate, up), m.w_down)
        c = self.cfg
        probs = F.softmax(F.linear(h, m.router), dim=-1, dtype=torch.float)                 # [T, E]
        top, sel = torch.topk(probs, c.experts_per_tok, dim=-1)                             # [T, k]
        if c.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter_(1, sel, top).to(h.dtype)                 # [T, E], 0 off the top k
        out = torch.zeros_like(h)
        # every expert on every token, weighted by 0 where not chosen: static shapes, no host sync (a grouped kernel
        # is what large expert counts need)
        for e, expert in enumerate(m.experts):
            out = out + self._mlp(expert, h) * weights[:, e:e + 1]
        return out + torch.sigmoid(F.linear(h, m.shared_gate)) * self._mlp(m.shared, h)

    def _hybrid_forward(self, tokens, pos, slots, attend, tree: GDNStash):
        """tokens, pos, slots [T] -> (final-norm hidden [T, H], taps [T, n_taps * H]). Attention layers write K/V
        into `slots`; GDN layers run over the tree of `tree.parents` and append their commit data to `tree`."""
        c = self.cfg
        T, eps = tokens.shape[0], c.rms_norm_eps
        x = F.embedding(tokens, self.embed)                                                 # [T, H]
        h = rms_norm_1p(x, self.layers[0].attn_norm, eps)
        taps = {}
        for i, layer in enumerate(self.layers):
            if layer.kind == "full_attention":
                mixed = self._attention(layer.mixer, layer.slot, h, pos, slots, attend)
            else:
                mixed = self._gdn(layer.mixer, layer.slot, h, tree)
            x, h = add_rms_norm(x, mixed, layer.mlp_norm, eps, one_plus=True)
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            x, h = add_rms_norm(x, self._mlp(layer.mlp, h), nxt, eps, one_plus=True)
            if i in self.tap_layer_ids:
                taps[i] = x
        taps = torch.cat([taps[i] for i in self.tap_layer_ids], -1) if taps else h.new_zeros(T, 0)
        return h, taps

    # ---- entry points ----------------------------------------------------------------------------
    @torch.no_grad()
    def verify_tree(self, tokens: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor, start,
                    parents: torch.Tensor | None = None, bits: torch.Tensor | None = None) -> DenseOutput:
        """Score a proposal tree in one pass; the committed GDN states are only read.

        tokens, depths [N] long (topological order, node 0 the root); anc [N, N] bool inclusive ancestor relation;
        start: committed length (int or long tensor [1]); parents [N] long (default: derived from anc); bits: anc
        packed, as DenseModel.verify_tree. Attention as DenseModel.verify_tree. Returns DenseOutput with logits
        [N, V], hidden [N, H] and taps for every node; the GDN commit data is kept for `commit`.
        """
        N, dev = tokens.shape[0], self.device
        if isinstance(start, int) and not 0 <= start <= self.max_seq_len - N:
            raise ValueError(f"a tree of {N} nodes after {start} committed tokens does not fit the static cache of "
                             f"{self.max_seq_len} slots")
        parents = tree_parents(anc) if parents is None else parents.to(dev)
        start = torch.as_tensor(start, device=dev).reshape(1)                               # [1]
        slots = start + self.slots[:N]                                                      # [N]
        if bits is None and "triton" in (self.attention, self.gdn):
            bits = tree_bits(anc)                                                           # [1, N, ceil(N/32)]
        if self.attention == "triton":
            attend = self._triton_attend(start, bits)
        else:
            mask = (self.slots < start)[None].expand(N, -1).clone()                         # [N, S] prefix
            mask.index_copy_(1, slots, anc)                                                 # + ancestors
            attend = lambda i, q, k, v: self._sdpa(i, q, mask, self.max_seq_len)            # noqa: E731
        if self.gdn == "triton":
            tree = GDNStash(parents=parents.to(torch.int32)[None].contiguous(), anc=bits)
        else:
            tree = GDNStash(parents=parents, win=conv_windows(parents, self.cfg.conv_kernel))
        h, taps = self._hybrid_forward(tokens, start + depths, slots, attend, tree)
        self._stash = tree
        return DenseOutput(F.linear(h, self.lm_head), h, taps)

    @torch.no_grad()
    def commit(self, start, accepted: torch.Tensor) -> None:
        """Keep the accepted path (tree nodes accepted [A] long on the device, root first): attention K/V move to
        slots start..start+A-1 (DenseModel.commit); each GDN layer's recurrent and conv state become those after the
        accepted leaf accepted[-1]."""
        if self._stash is None:
            raise RuntimeError("commit needs a verify_tree first (and commits each tree once)")
        super().commit(start, accepted)
        self.commit_states(accepted[-1:])

    def commit_states(self, leaf: torch.Tensor) -> None:
        """leaf [1] long: write each GDN layer's state after that node of the last verified tree into the pools
        (the GDN half of `commit`; K/V untouched); -1 keeps the committed states (no host read)."""
        tree, self._stash = self._stash, None
        if self.gdn == "triton":
            from tfm_kernels.gdn_tree import tree_conv1d_commit, tree_gdn_commit
            leaf32 = leaf.to(torch.int32)
            for j in range(self.num_gdn):
                idx = self.gdn_slots[j:j + 1]
                tree_gdn_commit(self.rec, idx, leaf32, tree.kernel[j], precision="ieee"
                                if self.dtype == torch.float32 else "tf32")
                tree_conv1d_commit(tree.mixed[j], self.conv, leaf32, tree.parents, idx)
            return
        keep, at = leaf >= 0, leaf.clamp(min=0)                                             # [1], [1]
        rows = tree.win.index_select(0, at)[0, 1:]                                          # [W-1] newest W-1 inputs
        for j in range(self.num_gdn):
            self.rec[j].copy_(torch.where(keep, tree.states[j].index_select(0, at)[0], self.rec[j]))
            self.conv[j].copy_(torch.where(keep, tree.ext[j].index_select(0, rows).transpose(0, 1), self.conv[j]))

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> DenseOutput:
        """tokens [T] long -> DenseOutput (logits of the last position [1, V]; hidden, taps of all T). Starts from
        empty GDN states and runs the prompt as chain trees of PREFILL_CHUNK tokens, each committed."""
        T, dev = tokens.shape[0], self.device
        if not 1 <= T <= self.max_seq_len:
            raise ValueError(f"prefill needs 1..{self.max_seq_len} tokens (max_seq_len), got {T}")
        self.rec.zero_()
        self.conv.zero_()
        hs, taps = [], []
        for s in range(0, T, PREFILL_CHUNK):
            n = min(PREFILL_CHUNK, T - s)
            ar = torch.arange(n, device=dev)
            chain = ar[:, None] >= ar[None, :]                                              # [n, n] causal
            out = self.verify_tree(tokens[s:s + n], ar, chain, s, parents=ar - 1)
            self.commit_states(ar[-1:])                                                       # K/V already in place
            hs.append(out.hidden)
            taps.append(out.taps)
        h = torch.cat(hs)
        return DenseOutput(F.linear(h[-1:], self.lm_head), h, torch.cat(taps))

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos) -> torch.Tensor:
        """token [1] long at position `pos` (int or long tensor [1]) -> logits [1, V]. Its K/V (slot pos) and GDN
        states are committed."""
        logits = self.verify_tree(token, self.depth0, self.one_node, pos, parents=self.leaf0 - 1,
                                  bits=self.one_node_bits).logits
        self.commit_states(self.leaf0)
        return logits
