"""The contract: one description of a (target, drafter, adapter) setup that every stage validates against.

Collect writes it into each shard manifest, train copies it into every checkpoint, export into the Hub
artifact, and the runtime checks it against the models it is handed. A mismatch anywhere raises
`ContractError` naming the field, the expected and the actual value.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

SHARD_SCHEMA_VERSION = 1


class ContractError(ValueError):
    """A value disagrees with the contract. `.field`, `.expected`, `.actual` say which and how."""

    def __init__(self, field_name: str, expected: Any, actual: Any, where: str = ""):
        self.field, self.expected, self.actual = field_name, expected, actual
        ctx = f" ({where})" if where else ""
        super().__init__(f"contract mismatch{ctx}: field '{field_name}' expected {expected!r}, got {actual!r}")


@dataclass(frozen=True)
class Contract:
    target_id: str                  # HF id or local path of the target
    target_revision: str | None
    drafter_id: str                 # DFlash drafter id or path
    drafter_revision: str | None
    vocab_size: int                 # rows of the target LM head
    target_hidden_size: int         # H: width of h_final and of each tap
    drafter_hidden_size: int        # width of DFlash hidden states (== H for z-lab drafters)
    tap_layer_ids: tuple[int, ...]  # DFlash convention: output of decoder layer i
    block_size: int                 # DFlash block (bonus + block_size-1 masks)
    mask_token_id: int
    candidate_pool: int             # K: DFlash top-K candidates per depth
    lookahead: int                  # L: depths Weaver scores (<= block_size - 1)
    tokenizer_hash: str | None = None
    shard_schema_version: int = SHARD_SCHEMA_VERSION
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "tap_layer_ids", tuple(int(i) for i in self.tap_layer_ids))
        if not 1 <= self.lookahead <= self.block_size - 1:
            raise ContractError("lookahead", f"1..block_size-1={self.block_size - 1}", self.lookahead)
        if not 1 <= self.candidate_pool <= self.vocab_size:
            raise ContractError("candidate_pool", f"1..vocab_size={self.vocab_size}", self.candidate_pool)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ContractError("mask_token_id", f"0..{self.vocab_size - 1}", self.mask_token_id)

    # ---- JSON round trip -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Contract":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown contract fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        missing = {f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING} - set(d)
        if missing:
            raise ValueError(f"contract is missing required fields {sorted(missing)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Contract":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        from tfm_runtime.io import atomic_write_text
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Contract":
        with open(path) as f:
            return cls.from_json(f.read())

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# Fields that must agree for two contracts to be interchangeable (ids/revisions are provenance: a
# locally saved copy of a model is still compatible; set strict_ids=True to require them too).
_SHAPE_FIELDS = ("vocab_size", "target_hidden_size", "drafter_hidden_size", "tap_layer_ids", "block_size",
                 "mask_token_id", "candidate_pool", "lookahead", "tokenizer_hash", "shard_schema_version")
_ID_FIELDS = ("target_id", "target_revision", "drafter_id", "drafter_revision")


def check_compatible(expected: Contract, actual: Contract, *, strict_ids: bool = False,
                     ignore: tuple[str, ...] = (), where: str = "") -> None:
    """Raise ContractError on the first field where `actual` disagrees with `expected`.

    A tokenizer hash of None on either side means "unknown" and is not compared.
    """
    fields = _SHAPE_FIELDS + (_ID_FIELDS if strict_ids else ())
    for name in fields:
        if name in ignore:
            continue
        e, a = getattr(expected, name), getattr(actual, name)
        if name == "tokenizer_hash" and (e is None or a is None):
            continue
        if e != a:
            raise ContractError(name, e, a, where)


def tokenizer_hash(tokenizer) -> str:
    """A stable hash of a tokenizer's vocabulary (token -> id) and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
