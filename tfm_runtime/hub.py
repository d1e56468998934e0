"""Load a published Weaver adapter from a local folder or a Hugging Face Hub id, and check it against the models it
will run with.

An adapter folder holds config.json (the Weaver config), model.safetensors and contract.json (the setup it was
trained for: target, drafter, sizes, tap layers, block, mask token, K, L); a published one adds README.md (model
card) and provenance.json. Only these files are read, and weights only from safetensors: a repository that holds
pickle checkpoints alone is refused, and pickle files are never downloaded. A Hub id goes through the Hugging Face
cache, so `HF_HUB_OFFLINE=1` loads what was downloaded before; the commit it resolved to is `adapter.commit_sha`.
"""
from __future__ import annotations

import os

from tfm_runtime.contract import Contract, ContractError
from tfm_runtime.models.common import PICKLE_SUFFIXES
from tfm_runtime.models.weaver import Weaver

ADAPTER_FILES = ["config.json", "*.safetensors", "contract.json", "README.md", "provenance.json"]


def is_local(path_or_repo_id: str) -> bool:
    """A local folder (existing, or spelled as a path) rather than a Hub id `org/name`."""
    p = path_or_repo_id
    return os.path.isdir(p) or p.startswith((".", "/", "~")) or p.count("/") != 1


def resolve(path_or_repo_id: str, revision: str | None = None) -> tuple[str, str | None]:
    """-> (local folder holding the adapter files, commit sha or None for a local folder)."""
    if is_local(path_or_repo_id):
        if not os.path.isdir(path_or_repo_id):
            raise FileNotFoundError(f"adapter folder {path_or_repo_id!r} does not exist")
        return path_or_repo_id, None
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(path_or_repo_id, revision=revision, allow_patterns=ADAPTER_FILES)
    except Exception as e:  # network, auth, offline without a cached copy: say what was asked for
        raise FileNotFoundError(f"no local folder {path_or_repo_id!r}, and could not fetch it from the Hub "
                                f"(revision {revision!r}): {type(e).__name__}: {e}") from e
    # the Hugging Face cache keeps each commit in snapshots/<commit sha>/
    return path, os.path.basename(os.path.normpath(path))


def _pickles_on_hub(repo_id: str, commit: str) -> list[str]:
    """Pickle checkpoint names in the repository at `commit` (listing only; empty when offline)."""
    from huggingface_hub import HfApi
    try:
        files = HfApi().list_repo_files(repo_id, revision=commit)
    except Exception:                                   # offline or unreachable: the folder's own message stands
        return []
    return sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))


def load_adapter(path_or_repo_id: str, revision: str | None = None, *, target=None, drafter=None, dtype=None,
                 device=None) -> Weaver:
    """The Weaver adapter at `path_or_repo_id` (a local folder or a Hub id `org/name`), in eval mode.

    `revision`: a Hub branch, tag or commit (default main). `target`: a TargetModel, a Hugging Face causal LM or
    its config; `drafter`: a DFlashDrafter or its DFlashConfig. Each given one is checked against the adapter's
    contract (vocab and hidden sizes, tap layers, block size, mask token, ...; for a TargetModel and a DFlashDrafter
    also which models they are: ids, revisions, tokenizer hash, see `check_adapter`): a disagreement raises
    `ContractError(field, expected, actual, where)`, the expected value being the contract's. SpeculativeDecoder
    makes the same check against the models it decodes with.

    The returned module carries `.contract` (Contract), `.commit_sha` (the Hub commit it was loaded from, None for a
    local folder) and `.source` (`path_or_repo_id`).
    """
    path, commit = resolve(path_or_repo_id, revision)
    where = f"adapter {path_or_repo_id}" + (f"@{commit[:12]}" if commit else "")
    if commit and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        pickles = _pickles_on_hub(path_or_repo_id, commit)
        held = f"; the repository holds pickle checkpoints {pickles}, which are never loaded (unpickling can run " \
               f"code)" if pickles else ""
        raise FileNotFoundError(f"{where}: no *.safetensors file{held}")
    model = Weaver.from_pretrained(path, dtype=dtype, device=device).eval()
    cpath = os.path.join(path, "contract.json")
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{where}: no contract.json beside the weights, so the target and drafter it was "
                                f"trained for are unknown; an adapter folder holds config.json, model.safetensors "
                                f"and contract.json")
    contract = Contract.load(cpath)
    check_adapter(contract, model, target=target, drafter=drafter, where=where)
    model.contract, model.commit_sha, model.source = contract, commit, path_or_repo_id
    return model


def check_adapter(contract: Contract, adapter: Weaver, *, target=None, drafter=None, where: str = "") -> None:
    """Raise ContractError on the first field where the adapter's config, the target or the drafter disagree with
    the contract (see `load_adapter`).

    Sizes are compared first, then which models they are, for a TargetModel and a DFlashDrafter (configs and plain
    Hugging Face models give sizes only): `model_id` must be the contract's `target_id` / `drafter_id` (two spellings
    of one local folder agree), and the revision and the target's tokenizer hash must match where both sides know
    them. A copy of the model under another name is declared with `ModelSpec(path, id=<the contract's id>)`.
    """
    from tfm_runtime.models.dflash import DFlashDrafter
    from tfm_runtime.models.target import TargetModel
    w = adapter.cfg
    pairs = [("target_hidden_size", contract.target_hidden_size, w.d_model, "adapter config d_model"),
             ("candidate_pool", contract.candidate_pool, w.candidate_pool, "adapter config"),
             ("lookahead", contract.lookahead, w.lookahead, "adapter config")]
    if target is not None:
        pairs += _target_pairs(contract, w, target)
    if drafter is not None:
        pairs += _drafter_pairs(contract, drafter)
    _check(pairs, where)
    if isinstance(target, TargetModel):
        _check(_target_identity(contract, target), where)
    if isinstance(drafter, DFlashDrafter):
        _check(_drafter_identity(contract, drafter), where)


COPY_HINT = "a copy of the model under another name: ModelSpec(path, id={!r})"


def _target_identity(contract: Contract, target):
    """(field, contract value, target value, what), lazily: the tokenizer is read only when the ids agree."""
    yield ("target_id", contract.target_id, target.model_id,
           f"target model_id; {COPY_HINT.format(contract.target_id)} for load_target or TargetModel(spec=...)")
    if contract.target_revision is not None and target.revision is not None:
        yield "target_revision", contract.target_revision, target.revision, "target revision"
    if contract.tokenizer_hash is not None:
        yield "tokenizer_hash", contract.tokenizer_hash, target.tokenizer_hash, f"tokenizer of {target.model_id}"


def _drafter_identity(contract: Contract, drafter):
    yield ("drafter_id", contract.drafter_id, drafter.model_id,
           f"drafter model_id; {COPY_HINT.format(contract.drafter_id)} for load_drafter")
    if contract.drafter_revision is not None and drafter.revision is not None:
        yield "drafter_revision", contract.drafter_revision, drafter.revision, "drafter revision"


def _check(pairs, where: str) -> None:
    for name, expected, actual, what in pairs:
        if not _same(name, expected, actual):
            raise ContractError(name, expected, actual, f"{where} vs {what}" if where else what)


def _same(name: str, expected, actual) -> bool:
    """Equal values; for the model ids also two spellings of one local folder (relative or absolute, a link)."""
    if expected == actual:
        return True
    return (name in ("target_id", "drafter_id") and isinstance(expected, str) and isinstance(actual, str)
            and os.path.isdir(expected) and os.path.isdir(actual) and os.path.samefile(expected, actual))


def _target_pairs(contract: Contract, w, target) -> list[tuple]:
    """(field, contract value, target value, what) for what can be read off a TargetModel, HF model or HF config."""
    from tfm_runtime.models.target import TargetModel
    if isinstance(target, TargetModel):
        vocab, hidden, layers = target.vocab_size, target.hidden_size, target.num_layers
        embed = target.embed_weight.shape[1]
        taps = target.tap_layer_ids
    elif hasattr(target, "get_output_embeddings"):                       # a Hugging Face causal LM
        c = target.config
        vocab, hidden, layers = target.get_output_embeddings().weight.shape[0], c.hidden_size, c.num_hidden_layers
        embed, taps = target.get_input_embeddings().weight.shape[1], ()
    elif hasattr(target, "vocab_size") and hasattr(target, "hidden_size"):     # a Hugging Face config
        vocab, hidden, layers, embed, taps = target.vocab_size, target.hidden_size, target.num_hidden_layers, None, ()
    else:
        raise TypeError(f"target must be a TargetModel, a Hugging Face causal LM or its config, got "
                        f"{type(target).__name__}")
    pairs = [("vocab_size", contract.vocab_size, vocab, "target"),
             ("target_hidden_size", contract.target_hidden_size, hidden, "target")]
    if embed is not None:
        pairs.append(("d_embed", w.d_embed, embed, "target input embedding width"))
    if contract.tap_layer_ids and max(contract.tap_layer_ids) >= layers:
        pairs.append(("tap_layer_ids", contract.tap_layer_ids, f"a {layers}-layer target", "target"))
    if taps:                                                             # a TargetModel built with its taps
        pairs.append(("tap_layer_ids", contract.tap_layer_ids, tuple(taps), "target taps"))
    return pairs


def _drafter_pairs(contract: Contract, drafter) -> list[tuple]:
    """(field, contract value, drafter value, what) for a DFlashDrafter or a DFlashConfig."""
    from tfm_runtime.models.dflash import DFlashConfig
    c = drafter if isinstance(drafter, DFlashConfig) else getattr(drafter, "cfg", None)
    if not isinstance(c, DFlashConfig):
        raise TypeError(f"drafter must be a DFlashDrafter or a DFlashConfig, got {type(drafter).__name__}")
    return [("vocab_size", contract.vocab_size, c.vocab_size, "drafter"),
            ("drafter_hidden_size", contract.drafter_hidden_size, c.hidden_size, "drafter"),
            ("tap_layer_ids", contract.tap_layer_ids, tuple(c.target_layer_ids), "drafter"),
            ("block_size", contract.block_size, c.block_size, "drafter"),
            ("mask_token_id", contract.mask_token_id, c.mask_token_id, "drafter")]
