"""Load the target, its tokenizer and the DFlash drafter named by a collect config; check them against each other
before any work (from configs only, no weights)."""
from __future__ import annotations

import torch

from pipelines.collect.config import CollectConfig
from tfm_runtime.contract import Contract, ContractError, tokenizer_hash
from tfm_runtime.loading import load_drafter, load_drafter_config, load_target, load_tokenizer, resolve_dtype, \
    target_facts

DEFAULT_BLOCK_SIZE = 16                   # DFlash block (bonus + 15 masks) of drafters trained from text-only shards


def resolve_device(cfg: CollectConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def check_pair(cfg: CollectConfig) -> Contract:
    """Raise (before any work) when the drafter cannot serve the target; return the run's contract."""
    t = target_facts(cfg.target)
    if cfg.drafter is None:
        return text_only_contract(cfg, t)
    d = load_drafter_config(cfg.drafter)
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
    return Contract(target_id=cfg.target.name, target_revision=cfg.target.revision, drafter_id=cfg.drafter.name,
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
    return Contract(target_id=cfg.target.name, target_revision=cfg.target.revision, drafter_id="",
                    drafter_revision=None, vocab_size=t["vocab_size"], target_hidden_size=t["hidden_size"],
                    drafter_hidden_size=t["hidden_size"], tap_layer_ids=(), block_size=DEFAULT_BLOCK_SIZE,
                    mask_token_id=t["vocab_size"] - 1, candidate_pool=min(cfg.candidate_pool, t["vocab_size"]),
                    lookahead=DEFAULT_BLOCK_SIZE - 1, tokenizer_hash=tokenizer_hash(tok),
                    extra={"drafter": None})


def load_models(cfg: CollectConfig, device: torch.device, with_drafter: bool = True):
    """-> (TargetModel with the drafter's taps, DFlashDrafter or None), on `device`, eval mode."""
    dtype = resolve_dtype(cfg.target, device)
    if cfg.drafter is None:
        assert not with_drafter, "anchor shards need a drafter (CollectConfig checks this)"
        drafter, taps = None, []
    elif not with_drafter:
        drafter, taps = None, load_drafter_config(cfg.drafter).target_layer_ids    # config only: no weights
    else:
        drafter = load_drafter(cfg.drafter, device, dtype)
        taps = drafter.cfg.target_layer_ids
    return load_target(cfg.target, taps, device, dtype), drafter
