"""The shard format: Parquet (zstd), one row per anchor (or per sequence in text-only mode), plus manifest.json.

Tensors are flattened fixed-size lists; their shapes are in the schema metadata ("tfm.shapes"). bf16 tensors are
stored as their raw 16-bit patterns (uint16), since Arrow has no bfloat16: `decode_bf16` turns them back.
This module is the one place the columns are defined; collect writes with it and train reads with it.
The manifest lists each shard's rows, bytes and sha256; both sides check a shard against them (`verify_shard`)
before trusting it, and train reads only folders whose manifest is marked `complete`.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.provenance import file_sha256
from tfm_runtime.contract import SHARD_SCHEMA_VERSION
from tfm_runtime.io import atomic_path, atomic_write_json

log = logging.getLogger("tfm.shards")


def anchor_columns(L: int, H: int, K: int, k: int, candidates: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """column -> (storage dtype, per-row shape). Without `candidates`, cand_ids/cand_logits are left out."""
    cols = {"sample_id": ("int64", ()), "anchor_pos": ("int64", ()), "root_token": ("int32", ()),
            "h_final": ("bf16", (H,)), "dflash_hidden": ("bf16", (L, H)),
            "cand_ids": ("int32", (L, K)), "cand_logits": ("bf16", (L, K)),
            "true_tokens": ("int32", (L,)), "target_topk_ids": ("int32", (L, k)),
            "target_topk_logprobs": ("bf16", (L, k)), "loss_mask": ("bool", (L,))}
    if not candidates:
        cols.pop("cand_ids"), cols.pop("cand_logits")
    return cols


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even) as uint16."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def decode_bf16(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _arrow(values: np.ndarray, dtype: str, shape: tuple[int, ...]) -> pa.Array:
    if dtype == "bf16":
        values = encode_bf16(values)
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape))) if shape else flat


def to_table(rows: dict[str, np.ndarray], columns: dict[str, tuple[str, tuple[int, ...]]], meta: dict) -> pa.Table:
    arrays = {name: _arrow(rows[name], dt, shape) for name, (dt, shape) in columns.items()}
    table = pa.table(arrays)
    md = {"tfm.shapes": json.dumps({n: [dt, list(s)] for n, (dt, s) in columns.items()}),
          "tfm.schema_version": str(SHARD_SCHEMA_VERSION), **{f"tfm.{k}": json.dumps(v) for k, v in meta.items()}}
    return table.replace_schema_metadata(md)


def column(table: pa.Table, name: str) -> np.ndarray:
    """A column back as a numpy array of shape [rows, *shape] (bf16 decoded to float32)."""
    shapes = json.loads(table.schema.metadata[b"tfm.shapes"])
    dt, shape = shapes[name]
    col = table.column(name).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False) if shape else col.to_numpy(zero_copy_only=False)
    arr = flat.reshape(len(table), *shape)
    return decode_bf16(arr) if dt == "bf16" else arr


def validate(rows: dict[str, np.ndarray], sequences: dict[int, list[int]], vocab_size: int) -> None:
    """Refuse a shard whose rows are not finite, mis-shaped or misaligned with their token sequences."""
    n = len(rows["sample_id"])
    for name, arr in rows.items():
        if arr.shape[0] != n:
            raise ValueError(f"shard validation: column {name} has {arr.shape[0]} rows, expected {n}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"shard validation: column {name} has non-finite values")
    for name in ("cand_ids", "root_token", "target_topk_ids"):
        if name not in rows:
            continue
        lo = -1 if name == "target_topk_ids" else 0
        if (rows[name] < lo).any() or (rows[name] >= vocab_size).any():
            raise ValueError(f"shard validation: {name} outside [{lo}, {vocab_size})")
    for r in range(n):
        seq, a = sequences[int(rows["sample_id"][r])], int(rows["anchor_pos"][r])
        L = rows["true_tokens"].shape[1]
        if rows["root_token"][r] != seq[a]:
            raise ValueError(f"shard validation: sample {rows['sample_id'][r]} anchor {a}: root token misaligned")
        want = np.array([seq[a + 1 + d] if a + 1 + d < len(seq) else -1 for d in range(L)], dtype=np.int32)
        if not np.array_equal(rows["true_tokens"][r], want) or not np.array_equal(rows["loss_mask"][r], want >= 0):
            raise ValueError(f"shard validation: sample {rows['sample_id'][r]} anchor {a}: true tokens misaligned")


def validate_text(rows: dict, sequences: dict[int, list[int]], vocab_size: int) -> None:
    """Refuse a text-only shard whose rows (sample_id, input_ids, prompt_len) are not their samples' token sequences,
    hold ids outside the vocabulary, or have no response token."""
    n = len(rows["sample_id"])
    for name in ("input_ids", "prompt_len"):
        if len(rows[name]) != n:
            raise ValueError(f"shard validation: column {name} has {len(rows[name])} rows, expected {n}")
    for sid, ids, p in zip(rows["sample_id"], rows["input_ids"], rows["prompt_len"]):
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"shard validation: sample {sid}: input_ids outside [0, {vocab_size})")
        if not 0 <= p < ids.size:
            raise ValueError(f"shard validation: sample {sid}: no response token (prompt_len {p}, {ids.size} ids)")
        if ids.tolist() != list(sequences[int(sid)]):
            raise ValueError(f"shard validation: sample {sid}: input_ids misaligned with its token sequence")


# sha256 of the files seen by this process, by (path, size, mtime, inode): each version of a file is read once
_SHA256: dict[tuple[str, int, int, int], str] = {}


def _sha256_of(path: str, st: os.stat_result) -> str:
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _SHA256:
        _SHA256[key] = file_sha256(path)
    return _SHA256[key]


def verify_shard(path: str, facts: dict) -> None:
    """Raise ValueError unless the file at `path` is the one the manifest describes (`facts`: bytes, sha256)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"shard {path}: the manifest lists it, but the file is missing") from None
    if st.st_size != facts["bytes"]:
        raise ValueError(f"shard {path}: {st.st_size} bytes, the manifest says {facts['bytes']} bytes")
    digest = _sha256_of(path, st)
    if digest != facts["sha256"]:
        raise ValueError(f"shard {path}: sha256 {digest[:16]}..., the manifest says {facts['sha256'][:16]}...")


def write_shard(table: pa.Table, path: str) -> dict:
    """Atomic Parquet (zstd) write -> {"rows", "bytes", "sha256"}."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    st = os.stat(path)
    return {"rows": table.num_rows, "bytes": st.st_size, "sha256": _sha256_of(path, st)}


def remove_temp_files(folder: str) -> int:
    """Delete the temp files of atomic writes (shards, manifest) that a killed run left in `folder` -> count."""
    import glob
    stale = [p for pattern in (".shard-*.parquet.*.tmp", ".manifest.json.*.tmp", ".collect_config.json.*.tmp")
             for p in glob.glob(os.path.join(glob.escape(folder), pattern))]
    for p in stale:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return len(stale)


def read_manifest(folder: str) -> dict:
    """The manifest.json of a collect output folder."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} is not a collect output folder: no manifest.json")
    with open(path) as f:
        return json.load(f)


class Manifest:
    """manifest.json: schema version, contract, config (+hash), provenance, per-shard facts, skipped inputs, the
    shards this run could not write ({name: error}), and `complete`: true only in the last write of a run that wrote
    every shard it had to."""

    def __init__(self, path: str, header: dict):
        self.path = path
        self.data = {**header, "shards": {}, "skipped": {}, "failed": {}, "complete": False}
        if os.path.isfile(path):
            with open(path) as f:
                old = json.load(f)
            if old.get("config_hash") == header["config_hash"]:
                self.data["shards"] = old.get("shards", {})

    def done(self, name: str, samples: list[int]) -> bool:
        """A shard counts as done when it is listed with the same sample range and its file is intact (size and
        sha256)."""
        s = self.data["shards"].get(name)
        if not s or s["samples"] != samples:
            return False
        try:
            verify_shard(os.path.join(os.path.dirname(self.path), name), s)
        except ValueError as e:
            log.warning("%s; collecting it again", e)
            return False
        return True

    def add(self, name: str, facts: dict) -> None:
        self.data["shards"][name] = facts
        self.data["failed"].pop(name, None)
        self.save()

    def fail(self, name: str, error: str) -> None:
        self.data["failed"][name] = error
        self.save()

    def finish(self, written: list[str]) -> None:
        """The run's last write: `complete` when every shard it had to write (`written`) is listed and none
        failed."""
        self.data["complete"] = not self.data["failed"] and all(n in self.data["shards"] for n in written)
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)
