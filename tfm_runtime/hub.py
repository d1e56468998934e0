"""Load a published Weaver adapter (local folder or Hugging Face Hub id): safetensors + config.json, validated."""
from __future__ import annotations

import os

from tfm_runtime.contract import Contract
from tfm_runtime.models.weaver import Weaver

ADAPTER_FILES = ["config.json", "*.safetensors", "contract.json", "README.md"]


def resolve(path_or_repo_id: str, revision: str | None = None) -> str:
    """A local folder as is; otherwise download the adapter files (never *.bin / *.pt) from the Hub."""
    if os.path.isdir(path_or_repo_id):
        return path_or_repo_id
    if os.path.sep in path_or_repo_id.strip("/").split("/", 1)[-1] or path_or_repo_id.startswith((".", "/")):
        raise FileNotFoundError(f"adapter folder {path_or_repo_id!r} does not exist")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path_or_repo_id, revision=revision, allow_patterns=ADAPTER_FILES)
    except Exception as e:  # network, auth, offline: say what was asked for
        raise FileNotFoundError(f"could not fetch adapter {path_or_repo_id!r} (revision {revision!r}) from the Hub: "
                                f"{type(e).__name__}: {e}") from e


def load_adapter(path_or_repo_id: str, revision: str | None = None, *, dtype=None, device=None) -> Weaver:
    """-> Weaver with `.contract` (a Contract, or None when the folder carries no contract.json)."""
    path = resolve(path_or_repo_id, revision)
    model = Weaver.from_pretrained(path, dtype=dtype, device=device).eval()
    cpath = os.path.join(path, "contract.json")
    model.contract = Contract.load(cpath) if os.path.isfile(cpath) else None
    if model.contract is not None:
        c, w = model.contract, model.cfg
        for name, expected, actual in [("target_hidden_size", c.target_hidden_size, w.d_model),
                                       ("candidate_pool", c.candidate_pool, w.candidate_pool),
                                       ("lookahead", c.lookahead, w.lookahead)]:
            if expected != actual:
                from tfm_runtime.contract import ContractError
                raise ContractError(name, expected, actual, f"adapter {path_or_repo_id}")
    return model
