"""The collect job on Ray Data: plan shards -> Rollout -> Featurize -> ShardWriter -> manifest.

One row of the Ray dataset is one shard's worth of samples (`samples_per_shard`, fixed by the input order), so
shard names and contents are deterministic and a re-run skips the shards the manifest already holds with the same
config hash. Each stage is a callable class that loads its models once per actor.

A stage that raises on a shard tries it again (`shard_retries` times) and then hands on an error row instead, which
the later stages pass through: the driver records the shard as failed and the other shards complete. An actor whose
process dies (out of memory, a crash) is restarted by Ray, which retries its shard as often.
"""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pyarrow as pa

from pipelines.collect.config import CollectConfig
from pipelines.collect.features import featurize_batch
from pipelines.collect.inputs import Sample
from pipelines.collect.models import load_models, resolve_device
from pipelines.shards import anchor_columns, to_table, validate, validate_text, write_shard
from tfm_runtime.loading import load_tokenizer

log = logging.getLogger("tfm.collect")


def _samples(row: dict) -> list[Sample]:
    resp = row.get("response_ids") or [None] * len(row["sample_ids"])
    return [Sample(s, p, r) for s, p, r in zip(row["sample_ids"], row["prompt_ids"], resp)]


class Stage:
    """One shard (one row) per call: `process(row) -> columns`. A row that carries an "error" (an earlier stage
    failed on its shard) passes through; a shard whose `process` raises is tried `retries` more times, then passes
    on as an error row {"name", "error"}."""

    retries = 0

    def __call__(self, batch: pa.Table) -> dict:
        row = batch.to_pylist()[0]
        if row.get("error"):
            return self.failed(row["name"], row["error"])
        for attempt in range(1 + self.retries):
            try:
                return self.process(row)
            except Exception as e:                       # noqa: BLE001 (any failure is the shard's, recorded by name)
                error = f"{type(self).__name__}: {type(e).__name__}: {e}"
                log.warning("%s: attempt %d of %d failed: %s", row["name"], attempt + 1, 1 + self.retries, error)
        return self.failed(row["name"], error)

    def process(self, row: dict) -> dict:
        raise NotImplementedError

    def failed(self, name: str, error: str) -> dict:
        return {"name": [name], "error": [error]}


class Rollout(Stage):
    """Regenerates the responses of one shard with the target."""

    def __init__(self, cfg: dict):
        self.cfg = CollectConfig.from_dict(cfg)
        self.retries = self.cfg.shard_retries
        self.device = resolve_device(self.cfg)
        self.target, _ = load_models(self.cfg, self.device, with_drafter=False)   # rollout needs no drafter
        self.tok = load_tokenizer(self.cfg.target)
        from pipelines.collect.rollout import fast_generator
        # Dense targets: one generator per actor, so its KV cache and captured decode steps serve every shard.
        self.generator = fast_generator(self.target.model, batch_size=self.cfg.rollout_batch_size,
                                        max_len=self.cfg.max_prompt_tokens + self.cfg.max_new_tokens)

    def process(self, row: dict) -> dict:
        from pipelines.collect.rollout import regenerate
        t0 = time.perf_counter()
        resp = regenerate(self.target.model, row["prompt_ids"], max_new_tokens=self.cfg.max_new_tokens,
                          temperature=self.cfg.temperature, eos_token_id=self.tok.eos_token_id,
                          pad_token_id=self.tok.pad_token_id, batch_size=self.cfg.rollout_batch_size,
                          seed=self.cfg.seed * 1_000_003 + row["shard"], generator=self.generator)
        return {**{k: [v] for k, v in row.items()}, "response_ids": [resp],
                "rollout_seconds": [time.perf_counter() - t0]}


class Featurize(Stage):
    """Target + DFlash features of one shard's anchors, as an Arrow table (IPC bytes)."""

    def __init__(self, cfg: dict, contract: dict):
        self.cfg = CollectConfig.from_dict(cfg)
        self.retries = self.cfg.shard_retries
        self.contract = contract
        self.device = resolve_device(self.cfg)
        # text-only shards are the rollout's token ids: no model is needed here
        self.target, self.drafter = (None, None) if self.cfg.text_only else load_models(self.cfg, self.device)

    def process(self, row: dict) -> dict:
        samples = _samples(row)
        sequences = {s.sample_id: s.prompt_ids + s.response_ids for s in samples}
        t0 = time.perf_counter()
        if self.cfg.text_only:
            rows = {"sample_id": [s.sample_id for s in samples], "input_ids": [sequences[s.sample_id] for s in samples],
                    "prompt_len": [len(s.prompt_ids) for s in samples]}
            validate_text(rows, sequences, self.contract["vocab_size"])
            table = pa.table({"sample_id": pa.array(rows["sample_id"], pa.int64()),
                              "input_ids": pa.array(rows["input_ids"], pa.list_(pa.int32())),
                              "prompt_len": pa.array(rows["prompt_len"], pa.int32())})
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
            validate(rows, sequences, c["vocab_size"])
            table = to_table(rows, cols, {"contract": c})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        tokens = sum(len(s.response_ids) for s in samples)
        return {"shard": [row["shard"]], "name": [row["name"]], "samples": [row["samples"]],
                "table": [sink.getvalue().to_pybytes()], "new_tokens": [tokens],
                "sequence_tokens": [sum(len(x) for x in sequences.values())],
                "rollout_seconds": [row.get("rollout_seconds", 0.0)],
                "featurize_seconds": [time.perf_counter() - t0]}


class ShardWriter(Stage):
    """Writes one shard atomically into the output folder and reports {"name", "facts", "error"} (facts as JSON;
    for a failed shard, "" and its error)."""

    def __init__(self, output_dir: str, retries: int = 0):
        self.output_dir, self.retries = output_dir, retries

    def process(self, row: dict) -> dict:
        table = pa.ipc.open_stream(row["table"]).read_all()
        facts = write_shard(table, os.path.join(self.output_dir, row["name"]))
        return {"name": [row["name"]], "facts": [json.dumps({**facts, "samples": row["samples"],
                                                             "new_tokens": row["new_tokens"],
                                                             "sequence_tokens": row["sequence_tokens"],
                                                             "rollout_seconds": row["rollout_seconds"],
                                                             "featurize_seconds": row["featurize_seconds"]})],
                "error": [""]}

    def failed(self, name: str, error: str) -> dict:
        return {"name": [name], "facts": [""], "error": [error]}


def quiet_ray_data_logs() -> None:
    """Ray Data's console output in the driver: warnings and errors only (its log file under the Ray session keeps
    everything). Also drops the warning that progress bars are off: the CLI draws its own bar over shards."""
    import logging

    from ray.data._internal.logging import SessionFileHandler
    for h in logging.getLogger("ray.data").handlers:
        if not isinstance(h, SessionFileHandler):
            h.setLevel(max(h.level, logging.WARNING))
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def _actor_options(cfg: CollectConfig) -> dict:
    """Actor restarts with bounded retries: an actor whose process dies is restarted and its shard retried
    `shard_retries` times (Ray Data's default retries it without end). With restarts on, the driver logs a warning
    per actor because Ray Data hands its actors a constructor argument from the object store (ray-project/ray#53727).
    Ray deprecates free-form actor options in map_batches (removal announced for 2.64); once they are gone, Ray's
    default stands (restarts, and retries without a bound)."""
    import inspect

    import ray
    params = inspect.signature(ray.data.Dataset.map_batches).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {"max_restarts": -1, "max_task_retries": cfg.shard_retries}
    return {}


def build_dataset(cfg: CollectConfig, contract: dict, work: list[dict]):
    """work: one dict per shard to produce -> a lazy Ray dataset of ShardWriter rows ({"name", "facts",
    "error"}). A shard whose tasks still fail after Ray's retries yields no row (Ray Data skips its block: see
    `run`, which sets DataContext.max_errored_blocks)."""
    import warnings

    import ray
    ds = ray.data.from_items(work, override_num_blocks=max(1, len(work)))
    opts = _actor_options(cfg)
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
        return ds.map_batches(ShardWriter, fn_constructor_kwargs={"output_dir": cfg.output_dir,
                                                                  "retries": cfg.shard_retries}, batch_size=1,
                              batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0, **opts)


def iter_inline(cfg: CollectConfig, contract: dict, work: list[dict]):
    """The same stages run one after another in this process, without Ray (small jobs, tests): yields the
    ShardWriter rows ({"name", "facts", "error"}) as `build_dataset` does."""
    d = cfg.to_dict()
    stages = ([Rollout(d)] if cfg.response == "regenerate" else []) + [Featurize(d, contract),
                                                                        ShardWriter(cfg.output_dir, cfg.shard_retries)]
    for item in work:
        batch = pa.Table.from_pylist([item])
        for stage in stages:
            batch = pa.Table.from_pydict(stage(batch))
        yield batch.to_pylist()[0]
