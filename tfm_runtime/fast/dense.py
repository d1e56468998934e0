"""Compact dense target (Llama, Qwen3) with a static KV cache, for one request at a time.

The weights come from a Hugging Face causal LM's state dict (shared with it, not copied) or from a safetensors
folder. The projections one input feeds run as one GEMM each (q, k and v; gate and up): `from_hf` first gives each
group one tensor, the HF modules' weights becoming views of it (`rehome_model`), so nothing is copied. The KV
cache is preallocated to `max_seq_len` slots and kept on the object. Every entry point has shapes that depend only
on its inputs' sizes and `max_seq_len`, never on how much of the cache is committed, so each one can be captured in
a CUDA graph (`start` / `pos` may be device tensors):

    prefill(tokens [T])                        slots and positions 0..T-1
    decode(token [1], pos [1])                 one token at slot and position `pos`
    verify_tree(tokens [N], depths [N], anc [N, N], start)
                                               tree nodes in slots start..start+N-1, at positions start + depth,
                                               each attending to the committed prefix and its own ancestors
    commit(start, accepted [A])                slots start + accepted -> slots start..start+A-1 (all layers at once)

Attention runs through torch SDPA with a boolean mask over the whole cache; on CUDA, decode and tree verify use the
Triton tree-attention kernel (tfm_kernels.tree_attention), which reads the committed prefix up to `start` and the
nodes' own keys. The math follows Hugging Face's Llama / Qwen3 (RMSNorm in fp32, RoPE tables in fp32, SwiGLU MLP,
Qwen3's per-head q/k RMSNorm), so logits agree with the HF model to rounding. On CUDA a layer's small steps run as
Triton kernels with the torch ops' roundings: each residual add with the next norm, the rotary embedding with the
K/V cache write, and the MLP's silu(gate) * up.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tfm_kernels.rms_norm import add_rms_norm as fused_add_rms_norm
from tfm_kernels.rms_norm import rms_norm as fused_rms_norm
from tfm_kernels.rope import rope_cache as fused_rope_cache
from tfm_runtime.models.common import inference_kernel_ok, kernel_device, silu_mul, small_linear_ok

FAMILIES = ("llama", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class DenseConfig:
    """What the dense forward needs from a Hugging Face config (`from_hf` refuses what it cannot run)."""
    family: str                          # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict = field(default_factory=dict)     # rope_type, rope_theta and the scaling parameters of that type
    qk_norm: bool = False                # Qwen3: RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config) -> "DenseConfig":
        """A transformers config (or its config.json as a dict) -> DenseConfig; ValueError names what is unsupported."""
        if isinstance(config, dict):
            from transformers import AutoConfig
            d = dict(config)
            kind = d.pop("model_type", None)
            _check_family(kind, d.get("layer_types"))
            config = AutoConfig.for_model(kind, **d)
        kind = getattr(config, "model_type", None)
        types = list(getattr(config, "layer_types", None) or [])
        _check_family(kind, types)
        other = sorted({t for t in types if t != "full_attention"})
        if other or getattr(config, "use_sliding_window", False):
            raise ValueError(f"the fast dense target runs full attention only; this {kind} config has "
                             f"{', '.join(map(repr, other)) or 'sliding-window'} layers (sliding_window="
                             f"{getattr(config, 'sliding_window', None)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"the fast dense target's MLP is SwiGLU (hidden_act='silu'), got {config.hidden_act!r}")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported by the fast dense target "
                             f"(supported: {ROPE_TYPES})")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial rotary embeddings are not supported, got partial_rotary_factor="
                             f"{rope['partial_rotary_factor']}")
        heads = config.num_attention_heads
        return cls(family=kind, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
                   num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rms_norm_eps=config.rms_norm_eps, rope=rope, qk_norm=kind == "qwen3",
                   attention_bias=bool(getattr(config, "attention_bias", False)),
                   mlp_bias=bool(getattr(config, "mlp_bias", False)),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def _check_family(kind: str | None, layer_types) -> None:
    if "linear_attention" in (layer_types or []) or (kind or "").startswith(("qwen3_next", "qwen3_5")):
        raise ValueError(f"{kind!r} is a hybrid target with Gated DeltaNet layers: DenseModel runs dense "
                         f"Llama / Qwen3 targets; use tfm_runtime.fast.hybrid.HybridModel (FastDecoder picks it)")
    if kind not in FAMILIES:
        raise ValueError(f"the fast dense target supports model types {FAMILIES}, got {kind!r}")


def rope_inv_freq(cfg: DenseConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, computed as transformers does for the rope types in ROPE_TYPES."""
    r, D = cfg.rope, cfg.head_dim
    inv_freq = 1.0 / (r["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    if r["rope_type"] == "linear":
        return inv_freq / r["factor"]
    if r["rope_type"] == "llama3":
        factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        old = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # short wavelengths stay, long ones are divided by `factor`, the band between is interpolated
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass
class Layer:
    """One decoder layer's weights ([out, in] like nn.Linear); biases and q/k norms are None when absent. The
    projections one input feeds are one tensor each (`fused_rows`): q, k, v one GEMM, gate and up one GEMM."""
    attn_norm: torch.Tensor              # [H]
    wqkv: torch.Tensor                   # [(Hq + 2 Hkv) * D, H]: q, k, v rows
    wo: torch.Tensor                     # [H, Hq * D]
    mlp_norm: torch.Tensor               # [H]
    w_gate_up: torch.Tensor              # [2 I, H]: gate, up rows
    w_down: torch.Tensor                 # [H, I]
    q_norm: torch.Tensor | None = None   # [D]
    k_norm: torch.Tensor | None = None   # [D]
    bqkv: torch.Tensor | None = None     # [(Hq + 2 Hkv) * D]
    bo: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None   # [2 I]
    b_down: torch.Tensor | None = None


@dataclass
class DenseOutput:
    logits: torch.Tensor                 # [T, V] (prefill: [1, V], the last position only)
    hidden: torch.Tensor                 # [T, H] final-norm hidden states (the LM head's input)
    taps: torch.Tensor                   # [T, n_taps * H] tap-layer outputs, concatenated in tap_layer_ids order


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] -> weight * x / rms(x), the mean of squares taken in fp32 (as Hugging Face does); on CUDA one launch
    of `tfm_kernels.rms_norm` with the same roundings."""
    if inference_kernel_ok(x, weight):
        return fused_rms_norm(x, weight, None, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] -> x / rms(x) * (1 + weight), in fp32, cast back (Qwen3-Next / Qwen3.5 RMSNorm); on CUDA one launch
    of `tfm_kernels.rms_norm` with the same rounding."""
    if inference_kernel_ok(x, weight):
        return fused_rms_norm(x, weight, None, eps, one_plus=True)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                 one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x + r (a block's output joining the residual stream) and its `rms_norm` (with `one_plus`: `rms_norm_1p`) ->
    (sum, norm); on CUDA one launch of `tfm_kernels.rms_norm.add_rms_norm`, the same roundings."""
    if inference_kernel_ok(x, r, weight):
        return fused_add_rms_norm(x, r, weight, None, eps, one_plus=one_plus)
    x = x + r
    return x, (rms_norm_1p if one_plus else rms_norm)(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D] -> RoPE'd x (the half-split "rotate_half" convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


def rope_into_cache(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                    one_plus: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """q [T, Hq, D] (or None: keys and values only), k, v [T, Hkv, D]; cos, sin tables [S, R] (R <= D: the first R
    dims rotate) read at pos [T] -> q, k rotated; k and v written to cache slots `slots` [T] of k_cache, v_cache
    [Hkv, S, D]. q_norm, k_norm [D] (or None): each head of q and k first goes through `rms_norm` (one_plus:
    `rms_norm_1p`). On CUDA one launch of `tfm_kernels.rope.rope_cache` with the same roundings (about twelve torch
    launches, and two norms)."""
    if inference_kernel_ok(k, v, cos, sin, k_cache, v_cache, q, q_norm, k_norm):
        return fused_rope_cache(q, k, v, cos, sin, pos, slots, k_cache, v_cache, q_norm=q_norm, k_norm=k_norm,
                                eps=eps, one_plus=one_plus)
    norm = rms_norm_1p if one_plus else rms_norm
    q = norm(q, q_norm, eps) if q is not None and q_norm is not None else q
    k = norm(k, k_norm, eps) if k_norm is not None else k
    c, s = cos[pos], sin[pos]                                                               # [T, R]
    R = c.shape[-1]

    def rope(x):                                                                            # R < D: partial rotary
        return rotate(x, c, s) if R == x.shape[-1] else torch.cat([rotate(x[..., :R], c, s), x[..., R:]], dim=-1)
    q, k = None if q is None else rope(q), rope(k)
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))
    return q, k


def tree_bits(anc: torch.Tensor) -> torch.Tensor:
    """anc [N, N] bool, a tree's ancestor mask -> its rows packed into int32 words [1, N, ceil(N/32)], the form the
    tree kernels read: one launch of `tfm_kernels.pack_bits` on CUDA, its torch reference elsewhere."""
    if kernel_device(anc):
        from tfm_kernels.pack_bits import pack_bits
        return pack_bits(anc.contiguous()[None])
    from tfm_kernels.tree_utils import pack_bits
    return pack_bits(anc[None])


def checked_weight(state: dict[str, torch.Tensor], missing: list[str], name: str, shape, needed: bool = True):
    """state[name] detached, after checking its shape (ValueError naming the weight); None if absent, and the name
    appended to `missing` when the weight is needed."""
    t = state.get(name)
    if t is None:
        if needed:
            missing.append(name)
        return None
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"weight {name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t.detach()


def fused_rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Weights [n_i, H] (or biases [n_i]) that one GEMM computes together -> one [sum n_i, ...] tensor: a view
    spanning them where they lie back to back in one storage (as `rehome_linears` leaves a model's), else their
    concatenation (a copy). None if any part is None."""
    if any(p is None for p in parts):
        return None
    parts = [p.detach() for p in parts]
    if not _back_to_back(parts):
        return torch.cat(parts)
    first = parts[0]
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(),
                            first.storage_offset())


@torch.no_grad()
def rehome_linears(linears) -> None:
    """Give these nn.Linear modules (one input feeds them all: q, k, v; gate, up) one weight tensor and one bias
    tensor, their own becoming consecutive row blocks of it, values unchanged, so that `fused_rows` spans them without
    a copy and one GEMM computes them all. The modules keep working (on views) and save as before; their old tensors
    are freed unless referenced elsewhere. Nothing changes where they already lie back to back, or where their dtypes,
    devices or bias presence differ, or a weight is not a plain tensor (e.g. quantized, or on the meta device)."""
    ws, bs = [m.weight for m in linears], [m.bias for m in linears]
    if (any(type(w.data) is not torch.Tensor or w.is_meta for w in ws)
            or len({(w.dtype, w.device, w.shape[1:]) for w in ws}) != 1 or len({b is None for b in bs}) != 1):
        return
    for params in (ws, bs):
        if params[0] is None or _back_to_back([p.data for p in params]):
            continue
        fused = torch.cat([p.data for p in params])                             # [sum n_i, ...]
        start = 0
        for p in params:
            p.data = fused[start:start + p.shape[0]]
            start += p.shape[0]


# the projections one input feeds, by module name (Hugging Face targets and our drafters alike): one GEMM each;
# the last is Qwen3.5's Gated DeltaNet input projections (mixed qkv, z, b, a)
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                 ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


def rehome_model(model: torch.nn.Module) -> None:
    """`rehome_linears` for every module of `model` that holds a FUSED_LINEARS group of nn.Linear."""
    for module in model.modules():
        for names in FUSED_LINEARS:
            group = [getattr(module, n, None) for n in names]
            if all(isinstance(g, torch.nn.Linear) for g in group):
                rehome_linears(group)


def _back_to_back(parts: list[torch.Tensor]) -> bool:
    """Contiguous tensors of one dtype, device and row shape, lying in order one after the other in one storage."""
    first, offset = parts[0], parts[0].storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.device != first.device
                or p.shape[1:] != first.shape[1:] or p.storage_offset() != offset
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        offset += p.numel()
    return True


class DenseModel:
    """A dense Llama / Qwen3 target for batch 1 with a static KV cache of `max_seq_len` slots.

    `tap_layer_ids`: decoder layers whose outputs (before the final norm) DFlash reads, as in TargetModel.
    `attention`: "sdpa", "triton" (CUDA only) or "auto" (Triton on CUDA where the kernel fits, else SDPA).
    Build with `DenseModel.from_hf(model, ...)` or `DenseModel.from_pretrained(folder, ...)`.
    """

    config_class = DenseConfig              # what from_hf / from_pretrained read the HF config into

    def __init__(self, cfg: DenseConfig, state: dict[str, torch.Tensor], tap_layer_ids=(), *,
                 max_seq_len: int = 2048, attention: str = "auto"):
        self.cfg = cfg
        bad = [i for i in tap_layer_ids if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"tap layer ids must be in [0, {cfg.num_layers - 1}], got {bad}")
        self.tap_layer_ids = tuple(int(i) for i in tap_layer_ids)
        self._load(state)
        dev, dt = self.embed.device, self.embed.dtype
        if attention == "auto":
            attention = "triton" if dev.type == "cuda" and dt in (torch.float16, torch.bfloat16, torch.float32) \
                else "sdpa"
        if attention not in ("sdpa", "triton") or (attention == "triton" and dev.type != "cuda"):
            raise ValueError(f"attention must be 'auto', 'sdpa' or 'triton' (CUDA only), got {attention!r} on {dev}")
        self.attention = attention
        self.setup_cache(max_seq_len)

    # ---- weights ---------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model, tap_layer_ids=(), **kw) -> "DenseModel":
        """From a Hugging Face *ForCausalLM (or a TargetModel, whose tap layers are then the default); the tensors
        are the model's own (no copy): the projections of each FUSED_LINEARS group are first re-homed into one
        tensor (`rehome_model`), which the model keeps using as views."""
        from tfm_runtime.models.target import TargetModel
        if isinstance(model, TargetModel):
            tap_layer_ids = tap_layer_ids or model.tap_layer_ids
            model = model.model
        cfg = cls.config_class.from_hf(model.config)
        rehome_model(model)
        return cls(cfg, dict(model.state_dict()), tap_layer_ids, **kw)

    @classmethod
    def from_pretrained(cls, path: str, tap_layer_ids=(), *, dtype: torch.dtype | None = None, device=None,
                        **kw) -> "DenseModel":
        """From a folder of config.json + *.safetensors (Hugging Face layout; never pickle)."""
        from tfm_runtime.models.common import load_safetensors_dir
        config, state = load_safetensors_dir(path)
        cfg = cls.config_class.from_hf(config)
        state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()}
        return cls(cfg, state, tap_layer_ids, **kw)

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        c = self.cfg
        state = {k.removeprefix("model."): v for k, v in state.items()}
        H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        missing = []
        get = functools.partial(checked_weight, state, missing)

        self.embed = get("embed_tokens.weight", (c.vocab_size, H))                          # [V, H]
        self.norm = get("norm.weight", (H,))                                                # [H]
        self.lm_head = get("lm_head.weight", (c.vocab_size, H), needed=not c.tie_word_embeddings)
        if self.lm_head is None:
            self.lm_head = self.embed                                                       # [V, H]
        self.layers = []
        for i in range(c.num_layers):
            p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            ab, mb = c.attention_bias, c.mlp_bias
            self.layers.append(Layer(
                attn_norm=get(p + "input_layernorm.weight", (H,)),
                wqkv=fused_rows([get(a + "q_proj.weight", (c.num_heads * D, H)),
                                 get(a + "k_proj.weight", (c.num_kv_heads * D, H)),
                                 get(a + "v_proj.weight", (c.num_kv_heads * D, H))]),
                wo=get(a + "o_proj.weight", (H, c.num_heads * D)),
                mlp_norm=get(p + "post_attention_layernorm.weight", (H,)),
                w_gate_up=fused_rows([get(m + "gate_proj.weight", (I, H)), get(m + "up_proj.weight", (I, H))]),
                w_down=get(m + "down_proj.weight", (H, I)),
                q_norm=get(a + "q_norm.weight", (D,), c.qk_norm), k_norm=get(a + "k_norm.weight", (D,), c.qk_norm),
                bqkv=fused_rows([get(a + "q_proj.bias", (c.num_heads * D,), ab),
                                 get(a + "k_proj.bias", (c.num_kv_heads * D,), ab),
                                 get(a + "v_proj.bias", (c.num_kv_heads * D,), ab)]),
                bo=get(a + "o_proj.bias", (H,), ab),
                b_gate_up=fused_rows([get(m + "gate_proj.bias", (I,), mb), get(m + "up_proj.bias", (I,), mb)]),
                b_down=get(m + "down_proj.bias", (H,), mb)))
        if missing:
            raise ValueError(f"{len(missing)} weights missing for this {c.family} config, e.g. {missing[:6]}")

    # ---- static buffers --------------------------------------------------------------------------
    def setup_cache(self, max_seq_len: int) -> None:
        """Allocate the KV cache and RoPE tables for `max_seq_len` slots (zeros: masked slots stay finite)."""
        self._attention_buffers(self.cfg.num_layers, max_seq_len, rope_inv_freq(self.cfg))

    def _attention_buffers(self, num_layers: int, max_seq_len: int, inv_freq: torch.Tensor) -> None:
        """KV cache [num_layers, Hkv, S, D], cos/sin [S, R] (R = 2 * len(inv_freq): the rotated dims) and the
        index constants."""
        c, dev, dt = self.cfg, self.embed.device, self.embed.dtype
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        shape = (num_layers, c.num_kv_heads, max_seq_len, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dt, device=dev)                             # [L, Hkv, S, D]
        self.v_cache = torch.zeros(shape, dtype=dt, device=dev)                             # [L, Hkv, S, D]
        # fp32 angles as transformers computes them, then cast: the same cos/sin as the HF model
        ang = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None]     # [S, R/2]
        ang = torch.cat([ang, ang], dim=-1)                                                 # [S, R]
        self.cos, self.sin = ang.cos().to(device=dev, dtype=dt), ang.sin().to(device=dev, dtype=dt)
        self.slots = torch.arange(max_seq_len, device=dev)                                  # [S]
        self.one_node = torch.ones(1, 1, dtype=torch.bool, device=dev)                      # decode's tree
        self.one_node_bits = tree_bits(self.one_node)                                       # [1, 1, 1] packed once
        self.depth0 = torch.zeros(1, dtype=torch.long, device=dev)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    # ---- forward ---------------------------------------------------------------------------------
    def _forward(self, tokens, pos, slots, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, pos, slots [T] -> (final-norm hidden [T, H], taps [T, n_taps * H]); writes K/V into `slots`.
        `attend(i, q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]` runs layer i's attention after the write."""
        c = self.cfg
        T, nh, nkv, D, eps = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        x = F.embedding(tokens, self.embed)                                                 # [T, H]
        w = self.layers[0]
        if small_linear_ok(x, T, (w.wqkv, w.wo, w.w_gate_up, w.w_down), w.attn_norm):
            return self._forward_small(x, pos, slots, attend)
        h = rms_norm(x, self.layers[0].attn_norm, eps)
        taps = {}
        for i, w in enumerate(self.layers):
            q, k, v = F.linear(h, w.wqkv, w.bqkv).split([nh * D, nkv * D, nkv * D], dim=-1)   # [T, .] views
            q, k, v = q.view(T, nh, D), k.view(T, nkv, D), v.view(T, nkv, D)
            q, k = rope_into_cache(q, k, v, self.cos, self.sin, pos, slots, self.k_cache[i], self.v_cache[i],
                                   w.q_norm, w.k_norm, eps)                                 # Qwen3: q / k norms
            o = attend(i, q, k, v)                                                          # [T, Hq, D]
            x, h = add_rms_norm(x, F.linear(o.reshape(T, nh * D), w.wo, w.bo), w.mlp_norm, eps)
            gate, up = F.linear(h, w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)                # [T, I] views
            mlp = F.linear(silu_mul(gate, up), w.w_down, w.b_down)
            x, h = add_rms_norm(x, mlp, self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm, eps)
            if i in self.tap_layer_ids:
                taps[i] = x
        taps = torch.cat([taps[i] for i in self.tap_layer_ids], -1) if taps else h.new_zeros(T, 0)
        return h, taps

    def _forward_small(self, x, pos, slots, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """`_forward` from the embeddings x [T, H] in CUDA inference over the rows and weights `small_linear` is for
        (decode and trees of small targets: launch-bound): each projection one launch of `tfm_kernels.small_linear`
        with the norm before it, the swiglu after it or the residual add after it fused in (the same roundings as the
        modules), so a layer takes five launches and the attention's."""
        from tfm_kernels.small_linear import small_linear
        c = self.cfg
        T, nh, nkv, D, eps = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        taps = {}
        for i, w in enumerate(self.layers):
            qkv = small_linear(x, w.wqkv, w.bqkv, norm_weight=w.attn_norm, eps=eps)           # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
            q, k, v = q.view(T, nh, D), k.view(T, nkv, D), v.view(T, nkv, D)
            q, k = rope_into_cache(q, k, v, self.cos, self.sin, pos, slots, self.k_cache[i], self.v_cache[i],
                                   w.q_norm, w.k_norm, eps)                                 # Qwen3: q / k norms
            o = attend(i, q, k, v)                                                          # [T, Hq, D]
            x = small_linear(o.reshape(T, nh * D), w.wo, w.bo, residual=x)                  # [T, H]
            g = small_linear(x, w.w_gate_up, w.b_gate_up, norm_weight=w.mlp_norm, eps=eps, swiglu=True,
                             silu_rounded=True)                                             # [T, I]
            x = small_linear(g, w.w_down, w.b_down, residual=x)                             # [T, H]
            if i in self.tap_layer_ids:
                taps[i] = x
        h = rms_norm(x, self.norm, eps)
        return h, (torch.cat([taps[i] for i in self.tap_layer_ids], -1) if taps else h.new_zeros(T, 0))

    def _sdpa(self, i: int, q: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """q [T, Hq, D] over cache slots [0, kv_len) of layer i; mask [T, kv_len] bool, or None for causal."""
        k = self.k_cache[i, None, :, :kv_len]                                              # [1, Hkv, kv, D]
        v = self.v_cache[i, None, :, :kv_len]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)                                # [1, Hq, T, D]
        return o[0].transpose(0, 1)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> DenseOutput:
        """tokens [T] long -> DenseOutput (logits of the last position [1, V]; hidden, taps of all T). Overwrites the
        cache from slot 0: the prompt becomes the committed prefix."""
        T = tokens.shape[0]
        if not 1 <= T <= self.max_seq_len:
            raise ValueError(f"prefill needs 1..{self.max_seq_len} tokens (max_seq_len), got {T}")
        pos = self.slots[:T]
        h, taps = self._forward(tokens, pos, pos, lambda i, q, k, v: self._sdpa(i, q, None, T))
        return DenseOutput(F.linear(h[-1:], self.lm_head), h, taps)

    @torch.no_grad()
    def verify_tree(self, tokens: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor, start,
                    bits: torch.Tensor | None = None) -> DenseOutput:
        """Score a proposal tree in one pass.

        tokens, depths [N] long (nodes in topological order, node 0 the root); anc [N, N] bool, inclusive ancestor
        relation (anc[i, j]: j is on the path root..i); start: committed length (int, or a long tensor [1] on the
        device). Node i is written to slot start + i at position start + depths[i] and attends to slots < start and
        its ancestors. Returns DenseOutput with logits [N, V], hidden and taps for every node. Slots from start on
        are not committed until `commit`. bits: anc packed ([1, N, ceil(N/32)] int32, `tree_bits`) where the caller
        has it already (decode's one-node tree).
        """
        N, dev = tokens.shape[0], self.device
        if isinstance(start, int) and not 0 <= start <= self.max_seq_len - N:
            raise ValueError(f"a tree of {N} nodes after {start} committed tokens does not fit the static cache of "
                             f"{self.max_seq_len} slots")
        start = torch.as_tensor(start, device=dev).reshape(1)                               # [1]
        slots = start + self.slots[:N]                                                      # [N]
        if self.attention == "triton":
            attend = self._triton_attend(start, tree_bits(anc) if bits is None else bits)
        else:
            mask = (self.slots < start)[None].expand(N, -1).clone()                         # [N, S] prefix
            mask.index_copy_(1, slots, anc)                                                 # + ancestors
            attend = lambda i, q, k, v: self._sdpa(i, q, mask, self.max_seq_len)            # noqa: E731
        h, taps = self._forward(tokens, start + depths, slots, attend)
        return DenseOutput(F.linear(h, self.lm_head), h, taps)

    def _triton_attend(self, start: torch.Tensor, bits: torch.Tensor):
        """Layer attention through the Triton tree kernel: the committed prefix is cache slots [0, start), the tree
        keys are the nodes' own; bits [1, N, ceil(N/32)]: the tree's ancestor mask, packed once for all layers."""
        from tfm_kernels.tree_attention import tree_attention
        N = bits.shape[1]
        n = torch.full((1,), N, dtype=torch.int32, device=bits.device)

        def attend(i, q, k, v):
            kp = self.k_cache[i].transpose(0, 1)[None]                                      # [1, S, Hkv, D]
            vp = self.v_cache[i].transpose(0, 1)[None]
            return tree_attention(q[None], k[None], v[None], kp, vp, start, bits, n)[0]     # [N, Hq, D]
        return attend

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos) -> torch.Tensor:
        """token [1] long at position `pos` (int or long tensor [1]), attending to slots < pos -> logits [1, V].
        Writes the token's K/V into slot pos, which becomes committed."""
        return self.verify_tree(token, self.depth0, self.one_node, pos, bits=self.one_node_bits).logits

    @torch.no_grad()
    def commit(self, start, accepted: torch.Tensor) -> None:
        """Move the accepted nodes' K/V (tree slots start + accepted, root first, in path order) to slots
        start..start+A-1, every layer in one gather and one scatter per cache. accepted [A] long on the device."""
        start = torch.as_tensor(start, device=self.device).reshape(1)
        src = start + accepted                                                              # [A]
        dst = start + torch.arange(accepted.shape[0], device=self.device)                   # [A]
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))                           # [L, Hkv, A, D]
