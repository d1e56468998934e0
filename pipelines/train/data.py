"""Training data: collect's shards through `datasets` (one memory-mapped Arrow table), a held-out split by sequence,
and a deterministic, distributed batch order that is a pure function of (seed, step): the data position of a
resumed run is its step, nothing else.

Only complete collect outputs are read (unless allowed), every shard is checked against its manifest's size and
sha256 before use, and the data's fingerprint (the shards' hashes) is part of the run hash: a resume on other
data is refused.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.shards import decode_bf16, read_manifest, verify_shard
from tfm_runtime.contract import SHARD_SCHEMA_VERSION, Contract, check_compatible


def data_fingerprint(folders: list[str]) -> tuple[str, dict[str, dict[str, str]]]:
    """-> (fingerprint, {folder: {shard name: sha256}}) of the shards the folders' manifests list."""
    shards = {f: {name: facts["sha256"] for name, facts in sorted(read_manifest(f)["shards"].items())}
              for f in folders}
    digest = hashlib.sha256(json.dumps([sorted(s.items()) for s in shards.values()]).encode()).hexdigest()[:16]
    return digest, shards


def check_complete(folder: str, manifest: dict) -> None:
    """Refuse a collect output whose manifest is not marked complete (collect writes the mark last)."""
    if manifest.get("complete") is not True:
        failed = manifest.get("failed") or {}
        why = f"failed shards: {failed}" if failed else "collect is still running or was interrupted"
        raise ValueError(f"{os.path.join(folder, 'manifest.json')} is not marked complete ({why}): run collect "
                         f"again with the same config to finish it, or set allow_incomplete_data: true to train on "
                         f"the {len(manifest.get('shards') or {})} shards it lists")


class ShardData:
    """All shards of one or more collect output folders (same contract and mode).

    `mode` is "anchors" (one row per anchor: Weaver) or "text_only" (one row per sequence: DFlash).
    Rows of a held-out sequence (by (folder, sample_id), `heldout_fraction` of them) are never trained on.
    Folders whose manifest is not marked complete are refused unless `allow_incomplete`; with `verify`, every
    shard is checked against its manifest (size and sha256) first.
    """

    def __init__(self, folders: list[str], *, mode: str, heldout_fraction: float, cache_dir: str,
                 allow_incomplete: bool = False, verify: bool = True):
        import datasets
        manifests = [read_manifest(f) for f in folders]
        first = manifests[0]
        self.contract = Contract.from_dict(first["contract"])
        for folder, m in zip(folders, manifests):
            if m.get("mode", "anchors") != mode:
                raise ValueError(f"{folder}: expected shards in {mode!r} mode (collect text_only="
                                 f"{mode == 'text_only'}), got {m.get('mode', 'anchors')!r}")
            if m["schema_version"] != SHARD_SCHEMA_VERSION:
                raise ValueError(f"{folder}: shard schema version {m['schema_version']}, this trainer reads "
                                 f"{SHARD_SCHEMA_VERSION}")
            check_compatible(self.contract, Contract.from_dict(m["contract"]), strict_ids=True,
                             where=f"{folder} vs {folders[0]}")
            for key in ("target_topk", "store_candidates"):              # the columns must agree
                if m["config"].get(key) != first["config"].get(key):
                    raise ValueError(f"{folder}: {key} {m['config'].get(key)} differs from "
                                     f"{first['config'].get(key)} in {folders[0]}")
        files, source = [], []
        for i, (folder, m) in enumerate(zip(folders, manifests)):
            for name in sorted(m["shards"]):
                files.append(os.path.join(folder, name))
                source.append(np.full(m["shards"][name]["rows"], i, dtype=np.int64))
        if not files:
            raise ValueError(f"no shards listed in the manifests of {folders}")
        for folder, m in zip(folders, manifests):
            if not allow_incomplete:
                check_complete(folder, m)
            if verify:
                for name, facts in m["shards"].items():
                    verify_shard(os.path.join(folder, name), facts)
        self.mode, self.files = mode, files
        self.file_starts = np.cumsum([0] + [len(x) for x in source])       # table row where each file begins
        meta = pq.read_schema(files[0]).metadata or {}
        self.shapes = {k: (dt, tuple(s)) for k, (dt, s) in json.loads(meta.get(b"tfm.shapes", b"{}")).items()}
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache_dir)
        self.table: pa.Table = ds.data.table                      # memory-mapped Arrow
        self.batches = self.table.to_batches()                    # zero-copy views of its record batches
        self.batch_starts = np.cumsum([0] + [b.num_rows for b in self.batches])
        source = np.concatenate(source)
        if len(source) != self.table.num_rows:
            raise ValueError(f"manifests list {len(source)} rows, the shards hold {self.table.num_rows}")
        sid = self.table.column("sample_id").to_numpy()
        key = (source * 1_000_003 + sid).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        held = (key >> np.uint64(40)).astype(np.float64) / float(1 << 24) < heldout_fraction
        self.train_index, self.heldout_index = np.nonzero(~held)[0], np.nonzero(held)[0]
        if len(self.train_index) == 0 or len(self.heldout_index) == 0:
            raise ValueError(f"{self.table.num_rows} rows split into {len(self.train_index)} training and "
                             f"{len(self.heldout_index)} held-out rows: collect more data or change heldout_fraction")

    def locate(self, index: np.ndarray) -> dict[str, list[int]]:
        """Table rows -> {shard file: its row numbers}, to name rows in messages."""
        out: dict[str, list[int]] = {}
        for r in sorted(int(i) for i in index):
            f = int(np.searchsorted(self.file_starts, r, side="right")) - 1
            out.setdefault(self.files[f], []).append(r - int(self.file_starts[f]))
        return out

    def take(self, index: np.ndarray) -> pa.Table:
        """Rows by table index, in that order, as one-chunk columns. Each record batch gives its own rows:
        `Table.take` on the whole table would concatenate every chunk of a column first (seconds per batch on a
        few GB of shards)."""
        index = np.asarray(index, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= self.table.num_rows):
            raise IndexError(f"row index out of range for {self.table.num_rows} rows")
        which = np.searchsorted(self.batch_starts, index, side="right") - 1      # [n] record batch of each row
        order = np.argsort(which, kind="stable")                                  # [n] rows grouped by batch
        parts = [self.batches[b].take(pa.array(index[order][which[order] == b] - self.batch_starts[b]))
                 for b in np.unique(which)]
        grouped = pa.Table.from_batches(parts, schema=self.table.schema).combine_chunks()
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return grouped.take(pa.array(inverse))

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """Rows by table index -> column -> array [n, *shape] (bf16 columns as float32; text ids as lists)."""
        t = self.take(index)
        out = {}
        for name in t.schema.names:
            col = t.column(name).combine_chunks()
            if name in self.shapes and self.shapes[name][1]:
                dt, shape = self.shapes[name]
                arr = col.flatten().to_numpy(zero_copy_only=False).reshape(len(t), *shape)
                out[name] = decode_bf16(arr) if dt == "bf16" else arr
            elif pa.types.is_list(col.type):
                out[name] = [np.asarray(v, dtype=np.int64) for v in col.to_pylist()]
            else:
                out[name] = col.to_numpy(zero_copy_only=False)
        return out


class BatchOrder:
    """Which training rows each rank reads at each (step, micro step): epoch e is a permutation seeded by
    (seed, e); a global batch of micro * accum * world consecutive entries is split rank-major per micro step."""

    def __init__(self, n: int, *, micro: int, accum: int, world: int, seed: int):
        self.n, self.micro, self.accum, self.world, self.seed = n, micro, accum, world, seed
        self.global_batch = micro * accum * world
        self.steps_per_epoch = n // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{n} training rows are fewer than one global batch ({micro} micro x {accum} accum x "
                             f"{world} ranks = {self.global_batch}): lower micro_batch or collect more data")
        self._epoch, self._perm = -1, None

    def indices(self, step: int, micro_step: int, rank: int) -> np.ndarray:
        """Positions into the training index for optimizer step `step` (0-based)."""
        epoch, j = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).numpy()
        start = j * self.global_batch + (micro_step * self.world + rank) * self.micro
        return self._perm[start:start + self.micro]


def open_run_data(cfg, mode: str) -> tuple[ShardData, np.ndarray]:
    """A run's shards and the fixed held-out rows it evaluates on (`cfg.eval_rows` of them, chosen by the seed).
    The first process of each machine (LOCAL_RANK 0, which builds the data first) verifies the shards."""
    data = ShardData(cfg.data, mode=mode, heldout_fraction=cfg.heldout_fraction,
                     cache_dir=os.path.join(cfg.output_dir, "hf_cache"), allow_incomplete=cfg.allow_incomplete_data,
                     verify=os.environ.get("LOCAL_RANK", "0") == "0")
    held = data.heldout_index
    pick = torch.randperm(len(held), generator=torch.Generator().manual_seed(cfg.seed)).numpy()[:cfg.eval_rows]
    return data, np.sort(held[pick])
