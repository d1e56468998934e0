"""DFlash block drafter (z-lab `DFlashDraftModel` layout), loadable from safetensors without remote code.

A few Qwen3-style decoder layers whose keys/values are [context features | noise block] and whose queries are
the noise block `[bonus, MASK x (B-1)]` (bidirectional, no causal mask). Context features are the target's
tap-layer outputs, concatenated and projected by `fc` then `hidden_norm`. The drafter has no embedding or LM
head of its own: the caller embeds with the target's embedding and projects with the target's LM head.

Weight names (as in z-lab checkpoints): fc.weight, hidden_norm.weight, norm.weight,
layers.N.{input_layernorm,post_attention_layernorm}.weight, layers.N.self_attn.{q,k,v,o}_proj.weight,
layers.N.self_attn.{q_norm,k_norm}.weight, layers.N.mlp.{gate,up,down}_proj.weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tfm_runtime.loading import ModelSpec
from tfm_runtime.models.common import (RMSNorm, SwiGLU, apply_rope, load_safetensors_dir, load_strict, rope_cos_sin,
                                       save_safetensors_dir)


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    layer_types: list[str] = field(default_factory=list)      # "full_attention" | "sliding_attention"
    sliding_window: int | None = None
    attention_bias: bool = False

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    # z-lab config.json <-> DFlashConfig
    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_target_layers": self.num_target_layers, "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window, "attention_bias": self.attention_bias,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        arch = d.get("architectures") or []
        if "DFlashDraftModel" not in arch:
            raise ValueError(f"not a DFlash drafter config: architectures={arch!r}, expected ['DFlashDraftModel']")
        rope = d.get("rope_scaling") or (d.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise NotImplementedError(f"DFlash rope type {rope_type!r} is not supported yet (only 'default')")
        theta = d.get("rope_theta", rope.get("rope_theta", 1e6) if isinstance(rope, dict) else 1e6)
        dc = d.get("dflash_config") or {}
        n_layers = d["num_hidden_layers"]
        from tfm_runtime.models.target import default_tap_layers
        ids = dc.get("target_layer_ids") or default_tap_layers(d["num_target_layers"], n_layers)
        if "mask_token_id" not in dc:
            raise ValueError("DFlash config lacks dflash_config.mask_token_id")
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_hidden_layers=n_layers, num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                   head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                   vocab_size=d["vocab_size"], num_target_layers=d["num_target_layers"],
                   target_layer_ids=list(ids), mask_token_id=dc["mask_token_id"],
                   block_size=d.get("block_size", 16), rope_theta=theta, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=d.get("max_position_embeddings", 40960),
                   layer_types=list(d.get("layer_types") or []), sliding_window=d.get("sliding_window"),
                   attention_bias=d.get("attention_bias", False))


class DFlashCache:
    """Context K/V per layer, kept across rounds: k, v [B, Hkv, T_ctx, D]. Noise-block K/V are never stored."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, sliding: bool):
        super().__init__()
        self.cfg, self.sliding = cfg, sliding
        nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(H, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin):
        """x [B, T, H] -> k, v [B, Hkv, T, D] (k normed and rotated)."""
        B, T, _ = x.shape
        hd, nkv = self.cfg.head_dim, self.cfg.num_key_value_heads
        k = self.k_norm(self.k_proj(x).view(B, T, nkv, hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, k_ctx, v_ctx, cos, sin, q_pos, k_pos):
        """x [B, S, H] noise block; k_ctx/v_ctx [B, Hkv, T, D]; q_pos [S], k_pos [T+S] -> [B, S, H]."""
        B, S, _ = x.shape
        hd, nh, nkv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_norm(self.q_proj(x).view(B, S, nh, hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(nh // nkv, dim=1)   # [B, nh, T+S, D]
        v = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(nh // nkv, dim=1)
        mask = None
        if self.sliding and self.cfg.sliding_window:
            mask = (k_pos[None, :] > q_pos[:, None] - self.cfg.sliding_window)      # [S, T+S]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, nh * hd))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, cfg.layer_types[idx] == "sliding_attention")
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@torch.no_grad()
def dflash_candidates(hidden: torch.Tensor, lm_head_weight: torch.Tensor, K: int, chunk: int = 64):
    """DFlash's top-K candidates per depth from its hidden states (collect stores them; the trainer recomputes
    them for shards without): hidden [A, L, H], lm_head_weight [V, H] -> (ids [A, L, K] long, logits [A, L, K]
    fp32 raw logits). `chunk` rows at a time bound the [chunk, L, V] logits."""
    ids, vals = [], []
    for i in range(0, hidden.shape[0], chunk):
        v, j = (hidden[i:i + chunk] @ lm_head_weight.T).float().topk(K, dim=-1)       # [a, L, K]
        ids.append(j), vals.append(v)
    return torch.cat(ids), torch.cat(vals)


class DFlashDrafter(nn.Module):
    """`spec` names the drafter (a ModelSpec; `from_pretrained` and `load_drafter` set it, None for one built in
    code): its `model_id` is what an adapter contract's `drafter_id` is checked against."""

    def __init__(self, cfg: DFlashConfig, spec=None):
        super().__init__()
        self.cfg = cfg
        self.spec = ModelSpec.of(spec)
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    @property
    def lookahead(self) -> int:
        return self.cfg.block_size - 1

    @property
    def model_id(self) -> str | None:
        return self.spec.name if self.spec is not None else None

    @property
    def revision(self) -> str | None:
        return self.spec.revision if self.spec is not None else None

    def new_cache(self) -> DFlashCache:
        return DFlashCache(len(self.layers))

    def extend_context(self, cache: DFlashCache, taps: torch.Tensor) -> None:
        """Append the K/V of new committed positions. taps [B, Tn, n_taps*H] at positions cache.length + (0..Tn-1)."""
        if taps.shape[1] == 0:
            return
        start = cache.length
        ctx = self.hidden_norm(self.fc(taps))                                          # [B, Tn, H]
        pos = torch.arange(start, start + taps.shape[1], device=taps.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            cache.k[i] = k if cache.k[i] is None else torch.cat([cache.k[i], k], dim=2)
            cache.v[i] = v if cache.v[i] is None else torch.cat([cache.v[i], v], dim=2)

    def forward(self, noise_emb: torch.Tensor, cache: DFlashCache) -> torch.Tensor:
        """noise_emb [B, S, H] (embedded [bonus, MASK...]) at positions T_ctx..T_ctx+S-1 -> normed hidden [B, S, H]."""
        B, S, _ = noise_emb.shape
        T = cache.length
        dev = noise_emb.device
        q_pos = torch.arange(T, T + S, device=dev)
        k_pos = torch.arange(0, T + S, device=dev)
        cos, sin = rope_cos_sin(q_pos, self.cfg.head_dim, self.cfg.rope_theta, noise_emb.dtype)
        x = noise_emb
        for i, layer in enumerate(self.layers):
            k_ctx = cache.k[i] if cache.k[i] is not None else x.new_zeros(B, self.cfg.num_key_value_heads, 0,
                                                                          self.cfg.head_dim)
            v_ctx = cache.v[i] if cache.v[i] is not None else k_ctx
            x = x + layer.self_attn(layer.input_layernorm(x), k_ctx, v_ctx, cos, sin, q_pos, k_pos)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def forward_blocks(self, taps: torch.Tensor, anchors: torch.Tensor, noise_emb: torch.Tensor,
                       seq_index: torch.Tensor | None = None) -> torch.Tensor:
        """Many anchors of one or several sequences in one pass (collection and training; docs/method.md §2.4).

        taps [B, T, n_taps*H] tap features of whole sequences (right-padded); anchors [A] block start positions;
        noise_emb [A, S, H] embedded blocks [x_a, MASK...] at positions a..a+S-1; seq_index [A] the row of taps
        each anchor belongs to (may be None when B == 1). Block a sees context positions < a of its own sequence
        and its own block (bidirectionally), never another block. Returns normed hidden [A, S, H]; equal to
        `draft` with a context cache holding taps[b, :a].
        """
        if seq_index is None and taps.shape[0] != 1:
            raise ValueError(f"forward_blocks: taps holds {taps.shape[0]} sequences; pass seq_index [A]")
        A, S, _ = noise_emb.shape
        T = taps.shape[1]
        dev, dt = noise_emb.device, noise_emb.dtype
        ctx = self.hidden_norm(self.fc(taps))                                            # [B, T, H]
        c_cos, c_sin = rope_cos_sin(torch.arange(T, device=dev), self.cfg.head_dim, self.cfg.rope_theta, dt)
        q_pos = anchors[:, None] + torch.arange(S, device=dev)                           # [A, S]
        cos, sin = rope_cos_sin(q_pos, self.cfg.head_dim, self.cfg.rope_theta, dt)       # [A, S, D]
        k_pos = torch.arange(T, device=dev)
        ctx_vis = k_pos[None, None, :] < anchors[:, None, None]                          # [A, 1, T]
        x = noise_emb
        nh, nkv, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        for layer in self.layers:
            att = layer.self_attn
            k_ctx, v_ctx = att.kv(ctx, c_cos, c_sin)                                     # [1, Hkv, T, D]
            h = layer.input_layernorm(x)
            q = apply_rope(att.q_norm(att.q_proj(h).view(A, S, nh, hd)).transpose(1, 2), cos, sin)
            k_blk, v_blk = att.kv(h, cos, sin)                                           # [A, Hkv, S, D]
            if seq_index is None:
                k_ctx, v_ctx = k_ctx.expand(A, -1, -1, -1), v_ctx.expand(A, -1, -1, -1)
            else:
                k_ctx, v_ctx = k_ctx[seq_index], v_ctx[seq_index]                       # [A, Hkv, T, D]
            k = torch.cat([k_ctx, k_blk], 2).repeat_interleave(nh // nkv, dim=1)
            v = torch.cat([v_ctx, v_blk], 2).repeat_interleave(nh // nkv, dim=1)
            vis = torch.cat([ctx_vis.expand(A, S, T), torch.ones(A, S, S, dtype=torch.bool, device=dev)], -1)
            if att.sliding and self.cfg.sliding_window:
                all_pos = torch.cat([k_pos.expand(A, T), q_pos], dim=1)                  # [A, T+S]
                vis = vis & (all_pos[:, None, :] > q_pos[:, :, None] - self.cfg.sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], scale=hd ** -0.5)
            x = x + att.o_proj(o.transpose(1, 2).reshape(A, S, nh * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @torch.no_grad()
    def draft(self, cache: DFlashCache, bonus: torch.Tensor, embed: nn.Module | torch.Tensor,
              lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bonus [B] -> (logits [B, L, V], hidden [B, L, H]) for block positions 1..L (L = block_size - 1)."""
        B = bonus.shape[0]
        ids = torch.full((B, self.cfg.block_size), self.cfg.mask_token_id, dtype=torch.long, device=bonus.device)
        ids[:, 0] = bonus
        emb = F.embedding(ids, embed) if isinstance(embed, torch.Tensor) else embed(ids)
        hidden = self.forward(emb, cache)[:, 1:]                                       # [B, L, H]
        return hidden @ lm_head_weight.T, hidden

    # ---- z-lab folder layout -----------------------------------------------------------------------
    def save_pretrained(self, path: str) -> None:
        save_safetensors_dir(path, self.cfg.to_hf_dict(), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype | None = None, device=None) -> "DFlashDrafter":
        config, state = load_safetensors_dir(path)
        model = cls(DFlashConfig.from_hf_dict(config), spec=path)
        load_strict(model, state, f"DFlash drafter at {path}")
        return model.to(device=device, dtype=dtype)
