"""The collect job on Ray Data: plan shards -> Rollout -> Featurize -> ShardWriter -> manifest.

One row of the Ray dataset is one shard's worth of samples (`samples_per_shard`, fixed by the input order), so
shard names and contents are deterministic and a re-run skips the shards the manifest already holds with the same
config hash. Each stage is a callable class that loads its models once per actor.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa

from pipelines.collect.config import CollectConfig
from pipelines.collect.features import featurize_batch
from pipelines.collect.inputs import Sample
from pipelines.collect.models import load_models, resolve_device
from pipelines.shards import anchor_columns, to_table, validate, write_shard
from tfm_runtime.loading import load_tokenizer


def _samples(batch) -> list[Sample]:
    rows = batch.to_pylist()[0]
    resp = rows.get("response_ids") or [None] * len(rows["sample_ids"])
    return [Sample(s, p, r) for s, p, r in zip(rows["sample_ids"], rows["prompt_ids"], resp)]


class Rollout:
    """Regenerates the responses of one shard with the target."""

    def __init__(self, cfg: dict):
        self.cfg = CollectConfig.from_dict(cfg)
        self.device = resolve_device(self.cfg)
        self.target, _ = load_models(self.cfg, self.device, with_drafter=False)   # rollout needs no drafter
        self.tok = load_tokenizer(self.cfg.target)
        from pipelines.collect.rollout import fast_generator
        # Dense targets: one generator per actor, so its KV cache and captured decode steps serve every shard.
        self.generator = fast_generator(self.target.model, batch_size=self.cfg.rollout_batch_size,
                                        max_len=self.cfg.max_prompt_tokens + self.cfg.max_new_tokens)

    def __call__(self, batch: pa.Table) -> dict:
        from pipelines.collect.rollout import regenerate
        row = batch.to_pylist()[0]
        t0 = time.perf_counter()
        resp = regenerate(self.target.model, row["prompt_ids"], max_new_tokens=self.cfg.max_new_tokens,
                          temperature=self.cfg.temperature, eos_token_id=self.tok.eos_token_id,
                          pad_token_id=self.tok.pad_token_id, batch_size=self.cfg.rollout_batch_size,
                          seed=self.cfg.seed * 1_000_003 + row["shard"], generator=self.generator)
        return {**{k: [v] for k, v in row.items()}, "response_ids": [resp],
                "rollout_seconds": [time.perf_counter() - t0]}


class Featurize:
    """Target + DFlash features of one shard's anchors, as an Arrow table (IPC bytes)."""

    def __init__(self, cfg: dict, contract: dict):
        self.cfg = CollectConfig.from_dict(cfg)
        self.contract = contract
        self.device = resolve_device(self.cfg)
        # text-only shards are the rollout's token ids: no model is needed here
        self.target, self.drafter = (None, None) if self.cfg.text_only else load_models(self.cfg, self.device)

    def __call__(self, batch: pa.Table) -> dict:
        row = batch.to_pylist()[0]
        samples = _samples(batch)
        t0 = time.perf_counter()
        if self.cfg.text_only:
            ids = [s.prompt_ids + s.response_ids for s in samples]
            table = pa.table({"sample_id": pa.array([s.sample_id for s in samples], pa.int64()),
                              "input_ids": pa.array(ids, pa.list_(pa.int32())),
                              "prompt_len": pa.array([len(s.prompt_ids) for s in samples], pa.int32())})
            table = table.replace_schema_metadata({"tfm.contract": json.dumps(self.contract)})
        else:
            c = self.cfg
            rows = featurize_batch(self.target, self.drafter, samples, anchors_per_sequence=c.anchors_per_sequence,
                                   candidate_pool=c.candidate_pool, target_topk=c.target_topk, seed=c.seed)
            c = self.contract
            cols = anchor_columns(c["lookahead"], c["target_hidden_size"], c["candidate_pool"],
                                  min(self.cfg.target_topk, c["vocab_size"]), self.cfg.store_candidates)
            if not rows:
                rows = {n: np.zeros((0, *shape), dtype=np.float32 if dt == "bf16" else dt)
                        for n, (dt, shape) in cols.items()}
            rows = {n: rows[n] for n in cols}
            validate(rows, {s.sample_id: s.prompt_ids + s.response_ids for s in samples}, c["vocab_size"])
            table = to_table(rows, cols, {"contract": c})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        tokens = sum(len(s.response_ids) for s in samples)
        return {"shard": [row["shard"]], "name": [row["name"]], "samples": [row["samples"]],
                "table": [sink.getvalue().to_pybytes()], "new_tokens": [tokens],
                "sequence_tokens": [sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)],
                "rollout_seconds": [row.get("rollout_seconds", 0.0)],
                "featurize_seconds": [time.perf_counter() - t0]}


class ShardWriter:
    """Writes one shard atomically into the output folder and reports its facts."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def __call__(self, batch: pa.Table) -> dict:
        row = batch.to_pylist()[0]
        table = pa.ipc.open_stream(row["table"]).read_all()
        facts = write_shard(table, os.path.join(self.output_dir, row["name"]))
        return {"name": [row["name"]], "facts": [json.dumps({**facts, "samples": row["samples"],
                                                             "new_tokens": row["new_tokens"],
                                                             "sequence_tokens": row["sequence_tokens"],
                                                             "rollout_seconds": row["rollout_seconds"],
                                                             "featurize_seconds": row["featurize_seconds"]})]}


def quiet_ray_data_logs() -> None:
    """Ray Data's console output in the driver: warnings and errors only (its log file under the Ray session keeps
    everything). Also drops the warning that progress bars are off: the CLI draws its own bar over shards."""
    import logging

    from ray.data._internal.logging import SessionFileHandler
    for h in logging.getLogger("ray.data").handlers:
        if not isinstance(h, SessionFileHandler):
            h.setLevel(max(h.level, logging.WARNING))
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def _actor_options() -> dict:
    """No actor restarts: a failed run is resumed from the manifest instead. With Ray Data's default
    (max_restarts=-1) the driver also logs an error line per actor, because Ray Data hands its actors a constructor
    argument from the object store (ray-project/ray#53727, #57733). Ray deprecates free-form actor options in
    map_batches (removal announced for 2.64); once they are gone, Ray's default stands."""
    import inspect

    import ray
    params = inspect.signature(ray.data.Dataset.map_batches).parameters.values()
    return {"max_restarts": 0} if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) else {}


def build_dataset(cfg: CollectConfig, contract: dict, work: list[dict]):
    """work: one dict per shard to produce -> a lazy Ray dataset of written-shard facts."""
    import warnings

    import ray
    ds = ray.data.from_items(work, override_num_blocks=max(1, len(work)))
    opts = _actor_options()
    res = {**opts, **({"num_gpus": cfg.gpus_per_actor} if cfg.gpus_per_actor else {})}
    pool = ray.data.ActorPoolStrategy(size=cfg.num_actors)
    d = cfg.to_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
        if cfg.response == "regenerate":
            ds = ds.map_batches(Rollout, fn_constructor_kwargs={"cfg": d}, batch_size=1, batch_format="pyarrow",
                                compute=pool, **res)
        ds = ds.map_batches(Featurize, fn_constructor_kwargs={"cfg": d, "contract": contract}, batch_size=1,
                            batch_format="pyarrow", compute=pool, **res)
        # The writer only does file I/O and reserves no CPU: it runs beside the model stages, so shards land (and
        # reach the manifest) while the rest is computing, not after the model actors are torn down.
        return ds.map_batches(ShardWriter, fn_constructor_kwargs={"output_dir": cfg.output_dir}, batch_size=1,
                              batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0, **opts)


def iter_inline(cfg: CollectConfig, contract: dict, work: list[dict]):
    """The same stages run one after another in this process, without Ray (small jobs, tests): yields the
    ShardWriter rows ({"name", "facts"}) as `build_dataset` does."""
    d = cfg.to_dict()
    stages = ([Rollout(d)] if cfg.response == "regenerate" else []) + [Featurize(d, contract),
                                                                        ShardWriter(cfg.output_dir)]
    for item in work:
        batch = pa.Table.from_pylist([item])
        for stage in stages:
            batch = pa.Table.from_pydict(stage(batch))
        yield batch.to_pylist()[0]
