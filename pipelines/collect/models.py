"""Load the target, its tokenizer and the DFlash drafter named by a collect config; check them against each other
before any work (from configs only, no weights)."""
from __future__ import annotations

import json
import os

import torch

from pipelines.collect.config import CollectConfig, ModelSpec
from tfm_runtime.contract import Contract, ContractError, tokenizer_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
TINY_VOCAB = 262
DEFAULT_BLOCK_SIZE = 16                   # DFlash block (bonus + 15 masks) of drafters trained from text-only shards


def _tiny(spec: ModelSpec) -> tuple[str, int] | None:
    if not spec.path.startswith("tiny:"):
        return None
    parts = spec.path.split(":")
    return parts[1], int(parts[2]) if len(parts) > 2 else 0


def is_tiny(spec: ModelSpec) -> bool:
    """A world built in code (`tiny:<family>[:seed]`), not a folder or Hub id."""
    return _tiny(spec) is not None


def resolve_device(cfg: CollectConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    if spec.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {spec.dtype!r}")
    return DTYPES[spec.dtype]


def load_tokenizer(spec: ModelSpec):
    if _tiny(spec):
        from tfm_runtime.worlds import tiny_tokenizer
        return tiny_tokenizer(TINY_VOCAB)
    from transformers import AutoTokenizer
    kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    return AutoTokenizer.from_pretrained(spec.path, revision=spec.revision, **kw)


def target_facts(spec: ModelSpec) -> dict:
    """vocab size, hidden size and layer count of the target, from its config only."""
    tiny = _tiny(spec)
    if tiny:
        from tfm_runtime.worlds import tiny_target_config
        c = tiny_target_config(tiny[0], TINY_VOCAB, 64, 6)
    else:
        if not spec.gguf_file and not os.path.isdir(spec.path) and os.path.sep in spec.path:
            raise FileNotFoundError(f"target model path {spec.path!r} does not exist")
        from transformers import AutoConfig
        kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        try:
            c = AutoConfig.from_pretrained(spec.path, revision=spec.revision, **kw)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"target model {spec.path!r} could not be found or read: {e}") from e
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers}


def drafter_config(spec: ModelSpec):
    from tfm_runtime.models.dflash import DFlashConfig
    tiny = _tiny(spec)
    if tiny:
        from tfm_runtime.worlds import tiny_world
        return tiny_world(tiny[0], seed=tiny[1], vocab_size=TINY_VOCAB).drafter.cfg
    path = os.path.join(spec.path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"drafter {spec.path!r}: expected a DFlash folder with config.json")
    with open(path) as f:
        return DFlashConfig.from_hf_dict(json.load(f))


def check_pair(cfg: CollectConfig) -> Contract:
    """Raise (before any work) when the drafter cannot serve the target; return the run's contract."""
    t = target_facts(cfg.target)
    if cfg.drafter is None:
        return text_only_contract(cfg, t)
    d = drafter_config(cfg.drafter)
    for name, expected, actual in [("vocab_size", t["vocab_size"], d.vocab_size),
                                   ("target_hidden_size", t["hidden_size"], d.hidden_size),
                                   ("num_target_layers", t["num_layers"], d.num_target_layers)]:
        if expected != actual:
            raise ContractError(name, expected, actual, f"drafter {cfg.drafter.path} vs target {cfg.target.path}")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t["num_layers"]]
    if bad:
        raise ContractError("tap_layer_ids", f"ids in [0, {t['num_layers'] - 1}]", d.target_layer_ids,
                            f"drafter {cfg.drafter.path}")
    tok = load_tokenizer(cfg.target)
    return Contract(target_id=cfg.target.path, target_revision=cfg.target.revision, drafter_id=cfg.drafter.path,
                    drafter_revision=cfg.drafter.revision, vocab_size=t["vocab_size"],
                    target_hidden_size=t["hidden_size"], drafter_hidden_size=d.hidden_size,
                    tap_layer_ids=tuple(d.target_layer_ids), block_size=d.block_size, mask_token_id=d.mask_token_id,
                    candidate_pool=min(cfg.candidate_pool, t["vocab_size"]), lookahead=d.block_size - 1,
                    tokenizer_hash=tokenizer_hash(tok))


def text_only_contract(cfg: CollectConfig, t: dict) -> Contract:
    """The contract of text-only shards collected without a drafter (to train one): the target's fields, no
    drafter id and no taps, and the mask token the new drafter will use: the embedding's last row (an unused
    padding row for most models; any fixed id works, DFlash learns what it means)."""
    tok = load_tokenizer(cfg.target)
    return Contract(target_id=cfg.target.path, target_revision=cfg.target.revision, drafter_id="",
                    drafter_revision=None, vocab_size=t["vocab_size"], target_hidden_size=t["hidden_size"],
                    drafter_hidden_size=t["hidden_size"], tap_layer_ids=(), block_size=DEFAULT_BLOCK_SIZE,
                    mask_token_id=t["vocab_size"] - 1, candidate_pool=min(cfg.candidate_pool, t["vocab_size"]),
                    lookahead=DEFAULT_BLOCK_SIZE - 1, tokenizer_hash=tokenizer_hash(tok),
                    extra={"drafter": None})


def load_models(cfg: CollectConfig, device: torch.device, with_drafter: bool = True):
    """-> (TargetModel with the drafter's taps, DFlashDrafter or None), on `device`, eval mode."""
    from tfm_runtime.models import DFlashDrafter
    from tfm_runtime.worlds import tiny_world
    dtype = resolve_dtype(cfg.target, device)
    if cfg.drafter is None:
        assert not with_drafter, "anchor shards need a drafter (CollectConfig checks this)"
        drafter, taps = None, []
    elif not with_drafter:
        drafter = None
        taps = drafter_config(cfg.drafter).target_layer_ids          # config only: no drafter weights
    elif d_tiny := _tiny(cfg.drafter):
        drafter = tiny_world(d_tiny[0], seed=d_tiny[1], vocab_size=TINY_VOCAB, dtype=dtype).drafter
    else:
        drafter = DFlashDrafter.from_pretrained(cfg.drafter.path, dtype=dtype)
    if drafter is not None:
        taps = drafter.cfg.target_layer_ids
    target = load_target(cfg.target, taps, device, dtype)
    return target, (drafter.to(device).eval() if drafter is not None else None)


def load_target(spec: ModelSpec, taps, device: torch.device, dtype: torch.dtype | None = None):
    """The target named by `spec` as a TargetModel tapping `taps`, on `device`, eval mode."""
    from tfm_runtime.models import TargetModel
    from tfm_runtime.worlds import tiny_world
    dtype = dtype or resolve_dtype(spec, device)
    tiny = _tiny(spec)
    if tiny:
        model = tiny_world(tiny[0], seed=tiny[1], vocab_size=TINY_VOCAB, dtype=dtype).target.model
    else:
        from transformers import AutoModelForCausalLM
        kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(spec.path, revision=spec.revision, dtype=dtype, **kw)
    return TargetModel(model.to(device).eval(), taps)
