"""What SGLang reads from our two artifacts, written down as tables, and the Weaver in the authors' fork layout.

Two consumers, each table taken from reading the consumer's loader (never run here: SGLang needs CUDA):

1. Upstream SGLang's DFlash draft model (sgl-project/sglang, 0.5.11 and later: `python/sglang/srt/models/dflash.py`
   `DFlashDraftModel` and `load_weights`, `python/sglang/srt/speculative/dflash_utils.py`
   `parse_dflash_draft_config`). The architecture name selects the class; `dflash_config` values win over the
   top-level ones of the same name. `load_weights` fuses q/k/v into qkv_proj and gate/up into gate_up_proj and
   silently skips any name it does not know, so a misspelt key would leave a random tensor: every key must be one
   of the table's, with the table's shape.

2. The authors' fork (trymirai/sglang at FORK_COMMIT, `python/sglang/srt/speculative/dflash_tfm.py`, class
   `Weaver`, method `load`): `torch.load(path)` of a dict {"config": ..., "state_dict": ...}; `Weaver(**config)`
   then `load_state_dict(state_dict, strict=True)`. Its RMSNorms all carry a bias and a fixed eps of 1e-6; its
   `K` is the tree depth Weaver scores (`uzu_tree.py` takes min(block_size - 1, K)), our lookahead L. The same
   class and loader are at commit 02700cab56df67cccba8ca0657d4d60430bb9b03; an older stored version (GELU MLP
   fc1/fc2, a learned position table pos_emb [K, d_rank], no RoPE) is a different model and is not targeted.

Shapes are written with the config's symbols: H hidden_size, I intermediate_size, nh num_attention_heads,
nkv num_key_value_heads, hd head_dim, taps len(target_layer_ids); d_model, d_embed, d_rank, mlp_dim as named.
"""
from __future__ import annotations

import torch

FORK_REPO = "trymirai/sglang"
FORK_COMMIT = "aeac03f0d4c8789559411be95c5c127bdff24d1c"
FORK_FILE = "sglang_dflash_tfm.pt"

# ---- 1. upstream SGLang, algorithm DFLASH: config.json fields and model.safetensors keys --------------------------
SGLANG_DFLASH_CONFIG = {
    "architectures": "a list holding 'DFlashDraftModel' (selects the model class)",
    "hidden_size": "H", "num_hidden_layers": "draft layers", "num_attention_heads": "nh",
    "num_key_value_heads": "nkv (default nh)", "head_dim": "hd (default H / nh)", "intermediate_size": "I > 0",
    "hidden_act": "'silu' (anything else is refused)", "rms_norm_eps": "(default 1e-6)",
    "attention_bias": "(default false)", "rope_theta": "rope base", "max_position_embeddings": "(default 32768)",
    "layer_types": "one of full_attention | sliding_attention per layer (+ sliding_window)",
    "dflash_config.target_layer_ids": "taps: ids in [0, num_target_layers)",
    "dflash_config.mask_token_id": "an int >= 0",
    "dflash_config.block_size": "block (falls back to the top-level block_size)",
    "dflash_config.num_target_layers": "target layers (falls back to the top-level num_target_layers)",
}
SGLANG_DFLASH_WEIGHTS = {
    "fc.weight": ("H", "taps*H"),
    "hidden_norm.weight": ("H",),
    "norm.weight": ("H",),
    "layers.{i}.input_layernorm.weight": ("H",),
    "layers.{i}.post_attention_layernorm.weight": ("H",),
    "layers.{i}.self_attn.q_proj.weight": ("nh*hd", "H"),
    "layers.{i}.self_attn.k_proj.weight": ("nkv*hd", "H"),
    "layers.{i}.self_attn.v_proj.weight": ("nkv*hd", "H"),
    "layers.{i}.self_attn.o_proj.weight": ("H", "nh*hd"),
    "layers.{i}.self_attn.q_norm.weight": ("hd",),
    "layers.{i}.self_attn.k_norm.weight": ("hd",),
    "layers.{i}.mlp.gate_proj.weight": ("I", "H"),
    "layers.{i}.mlp.up_proj.weight": ("I", "H"),
    "layers.{i}.mlp.down_proj.weight": ("H", "I"),
}
SGLANG_DFLASH_BIASES = {                 # present exactly when attention_bias is true
    "layers.{i}.self_attn.q_proj.bias": ("nh*hd",), "layers.{i}.self_attn.k_proj.bias": ("nkv*hd",),
    "layers.{i}.self_attn.v_proj.bias": ("nkv*hd",), "layers.{i}.self_attn.o_proj.bias": ("H",),
}

# ---- 2. the fork's Weaver: config fields and state_dict keys --------------------------------------------------------
FORK_CONFIG_FIELDS = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K",
                      "candidate_pool_size", "encoder_mode", "score_head", "activation", "rope_base")
FORK_ENCODER_GLOBAL_PROMPT, FORK_SCORE_SIMPLE = 3, 4       # the only values the fork accepts
FORK_RMS_EPS = 1e-6
FORK_WEIGHTS = {
    "output_norm.weight": ("d_model",), "output_norm.bias": ("d_model",),
    "embed_norm.weight": ("d_embed",), "embed_norm.bias": ("d_embed",),
    "token_in.weight": ("d_rank", "d_embed"), "token_in.bias": ("d_rank",),
    "proposal_in.weight": ("d_rank", "d_model"), "proposal_in.bias": ("d_rank",),
    "blocks.{i}.norm_attn.weight": ("d_rank",), "blocks.{i}.norm_attn.bias": ("d_rank",),
    "blocks.{i}.qkv_proj.weight": ("3*d_rank", "d_rank"),
    "blocks.{i}.o_proj.weight": ("d_rank", "d_rank"),
    "blocks.{i}.norm_mlp.weight": ("d_rank",), "blocks.{i}.norm_mlp.bias": ("d_rank",),
    "blocks.{i}.gate_up_proj.weight": ("2*mlp_dim", "d_rank"), "blocks.{i}.gate_up_proj.bias": ("2*mlp_dim",),
    "blocks.{i}.down_proj.weight": ("d_rank", "mlp_dim"), "blocks.{i}.down_proj.bias": ("d_rank",),
    "out_norm.weight": ("d_rank",), "out_norm.bias": ("d_rank",),
    "lm_head_query_in.weight": ("d_model", "d_rank"),
}
# our names -> theirs (the rest are equal); the three bias-free RMSNorms of ours get a zero bias there
FORK_RENAMES = {"attn_norm": "norm_attn", "mlp_norm": "norm_mlp"}
FORK_ZERO_BIASES = ("blocks.{i}.norm_attn.bias", "blocks.{i}.norm_mlp.bias", "out_norm.bias")


def _dim(expr: str, sym: dict) -> int:
    """'nkv*hd' -> sym['nkv'] * sym['hd'] (factors are symbols or integers)."""
    out = 1
    for f in expr.split("*"):
        out *= int(f) if f.isdigit() else sym[f]
    return out


def expand(table: dict, sym: dict, layers: int) -> dict[str, tuple[int, ...]]:
    """A table of templates -> {key: shape} for `layers` layers."""
    out = {}
    for key, dims in table.items():
        for i in (range(layers) if "{i}" in key else [None]):
            out[key.format(i=i)] = tuple(_dim(d, sym) for d in dims)
    return out


def _compare(what: str, expected: dict, actual: dict) -> None:
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    shapes = [f"{k}: expected {list(expected[k])}, got {list(actual[k])}"
              for k in sorted(expected) if k in actual and tuple(actual[k]) != tuple(expected[k])]
    if missing or unexpected or shapes:
        raise ValueError(f"{what}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]} (the loader would "
                         f"skip them), shape mismatches {shapes[:8]}")


# ---- 1. checks of a DFlash folder against upstream SGLang's tables --------------------------------------------------
def sglang_dflash_config(config: dict) -> dict:
    """The values SGLang resolves from a drafter config.json (dflash_config first, then the top level); raises
    ValueError naming the field SGLang would refuse or read wrongly."""
    where = "config.json (as SGLang's DFlash loader reads it)"
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        raise ValueError(f"{where}: architectures must hold 'DFlashDraftModel', got {config.get('architectures')!r}")
    dc = config.get("dflash_config") or {}
    v = {k: dc.get(k, config.get(k)) for k in ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers")}
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(config.get(k), int) or config[k] <= 0:
            raise ValueError(f"{where}: {k} must be a positive int, got {config.get(k)!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act must be 'silu', got {config.get('hidden_act')!r}")
    if not isinstance(v["mask_token_id"], int) or isinstance(v["mask_token_id"], bool) or v["mask_token_id"] < 0:
        raise ValueError(f"{where}: dflash_config.mask_token_id must be an int >= 0, got {v['mask_token_id']!r}")
    for k in ("block_size", "num_target_layers"):
        if not isinstance(v[k], int) or v[k] < 1:
            raise ValueError(f"{where}: dflash_config.{k} must be an int >= 1, got {v[k]!r}")
    ids = v["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < v["num_target_layers"]
                                                       for i in ids):
        raise ValueError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints in "
                         f"[0, {v['num_target_layers']}), got {ids!r}")
    types = config.get("layer_types")
    if types is not None and (len(types) != config["num_hidden_layers"]
                              or any(t not in ("full_attention", "sliding_attention") for t in types)):
        raise ValueError(f"{where}: layer_types must hold full_attention | sliding_attention for each of the "
                         f"{config['num_hidden_layers']} layers, got {types!r}")
    if types and "sliding_attention" in types and not config.get("sliding_window"):
        raise ValueError(f"{where}: sliding_attention layers need sliding_window")
    return v


def sglang_dflash_keys(config: dict) -> dict[str, tuple[int, ...]]:
    """The exact weight keys and shapes SGLang's DFlashDraftModel expects for `config`."""
    v = sglang_dflash_config(config)
    nh = config["num_attention_heads"]
    sym = {"H": config["hidden_size"], "I": config["intermediate_size"], "nh": nh,
           "nkv": config.get("num_key_value_heads") or nh,
           "hd": config.get("head_dim") or config["hidden_size"] // nh, "taps": len(v["target_layer_ids"])}
    table = {**SGLANG_DFLASH_WEIGHTS, **(SGLANG_DFLASH_BIASES if config.get("attention_bias") else {})}
    return expand(table, sym, config["num_hidden_layers"])


def check_sglang_dflash(config: dict, header: dict) -> None:
    """A DFlash folder's config.json and safetensors header (name -> {"shape": ...}) against SGLang's table."""
    actual = {k: tuple(h["shape"]) for k, h in header.items() if k != "__metadata__"}
    _compare("model.safetensors against SGLang's DFlashDraftModel", sglang_dflash_keys(config), actual)


# ---- 2. the Weaver in the fork's layout ---------------------------------------------------------------------------
def fork_config(wcfg) -> dict:
    """Our WeaverConfig as the fork's `Weaver(**config)` keyword arguments."""
    if wcfg.rms_eps != FORK_RMS_EPS:
        raise ValueError(f"the fork's Weaver RMSNorms use eps {FORK_RMS_EPS}, this adapter's rms_eps is "
                         f"{wcfg.rms_eps}: its sglang-dflash-tfm checkpoint would compute something else")
    return {"d_model": wcfg.d_model, "d_embed": wcfg.d_embed, "d_rank": wcfg.d_rank, "num_layers": wcfg.num_layers,
            "num_heads": wcfg.num_heads, "mlp_dim": wcfg.mlp_dim, "K": wcfg.lookahead,
            "candidate_pool_size": wcfg.candidate_pool, "encoder_mode": FORK_ENCODER_GLOBAL_PROMPT,
            "score_head": FORK_SCORE_SIMPLE, "activation": "swiglu", "rope_base": float(wcfg.rope_base)}


def fork_name(name: str) -> str:
    """Our Weaver parameter name -> the fork's (blocks.0.attn_norm.weight -> blocks.0.norm_attn.weight)."""
    parts = name.split(".")
    return ".".join(FORK_RENAMES.get(p, p) for p in parts)


def fork_state_dict(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our Weaver state dict -> the fork's: renamed norms, a zero bias for each of our bias-free RMSNorms."""
    out = {fork_name(k): v.detach().cpu().contiguous() for k, v in state.items()}
    for key in FORK_ZERO_BIASES:
        for i in (range(num_layers) if "{i}" in key else [None]):
            bias = key.format(i=i)
            out[bias] = torch.zeros_like(out[bias.rsplit(".", 1)[0] + ".weight"])
    return out


def fork_keys(config: dict) -> dict[str, tuple[int, ...]]:
    """The exact state_dict keys and shapes the fork's `Weaver(**config)` has."""
    return expand(FORK_WEIGHTS, config, config["num_layers"])


def check_fork_payload(payload: dict) -> None:
    """The fork's loader's view of a payload: the config's field names (its constructor refuses others), the only
    encoder/score/activation values it accepts, and strict state_dict keys and shapes."""
    config = payload["config"]
    if set(config) != set(FORK_CONFIG_FIELDS):
        raise ValueError(f"fork Weaver config: fields {sorted(config)}, the fork's constructor takes "
                         f"{sorted(FORK_CONFIG_FIELDS)}")
    fixed = {"encoder_mode": FORK_ENCODER_GLOBAL_PROMPT, "score_head": FORK_SCORE_SIMPLE, "activation": "swiglu"}
    for k, want in fixed.items():
        if config[k] != want:
            raise ValueError(f"fork Weaver config: {k} must be {want!r}, got {config[k]!r}")
    if config["d_rank"] % config["num_heads"] or (config["d_rank"] // config["num_heads"]) % 2:
        raise ValueError("fork Weaver config: d_rank must split into num_heads heads of even size (RoPE)")
    actual = {k: tuple(v.shape) for k, v in payload["state_dict"].items()}
    _compare("fork Weaver state_dict", fork_keys(config), actual)


def write_fork_checkpoint(path: str, weaver_state: dict[str, torch.Tensor], wcfg) -> dict:
    """Write our Weaver as the fork's torch checkpoint (a dict of plain values and tensors, loadable with
    `torch.load(weights_only=True)`), after checking it against the fork's table. Returns the payload."""
    config = fork_config(wcfg)
    payload = {"config": config, "state_dict": fork_state_dict(weaver_state, wcfg.num_layers),
               "format": f"sglang-dflash-tfm ({FORK_REPO}@{FORK_COMMIT})"}
    check_fork_payload(payload)
    torch.save(payload, path)
    return payload
