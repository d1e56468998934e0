"""python -m pipelines.collect --config collect.yaml

Rolls out the target on prompts and writes validated Arrow/Parquet shards + manifest.json (the shard format: pipelines/shards.py).
On a cluster:  ray job submit --working-dir . -- python -m pipelines.collect --config collect.yaml
Without one, a local Ray starts. Re-running with the same config resumes: finished shards (intact by sha256) are
skipped. Exit codes: 0 done (the manifest is marked complete), 2 bad config or input (nothing was collected),
3 some shards failed after their retries, or the Ray job stalled (no shard finished for `stall_seconds`): the
summary names them; running again retries only those.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time

from pipelines.collect.config import CollectConfig
from pipelines.collect.inputs import fingerprint, list_input_files, read_records, tokenize
from pipelines.collect.models import check_pair
from pipelines.shards import Manifest, remove_temp_files
from pipelines.provenance import provenance
from tfm_runtime.io import atomic_write_json
from tfm_runtime.loading import load_tokenizer

log = logging.getLogger("tfm.collect")


def plan(cfg: CollectConfig, samples, manifest: Manifest, data_hash: str) -> tuple[list[dict], int]:
    """Fixed-size shards over the usable samples in input order -> (work for unfinished shards, shards done)."""
    work, done = [], 0
    for k, start in enumerate(range(0, len(samples), cfg.samples_per_shard)):
        chunk = samples[start:start + cfg.samples_per_shard]
        name = f"shard-{k:05d}-{data_hash}.parquet"
        span = [chunk[0].sample_id, chunk[-1].sample_id]
        if manifest.done(name, span):
            done += 1
            continue
        manifest.data["shards"].pop(name, None)              # listed but missing or damaged: not done any more
        item = {"shard": k, "name": name, "samples": span, "sample_ids": [s.sample_id for s in chunk],
                "prompt_ids": [s.prompt_ids for s in chunk]}
        if cfg.response == "keep":
            item["response_ids"] = [s.response_ids for s in chunk]
        work.append(item)
    return work, done


def run(cfg: CollectConfig, progress: bool = True, use_ray: bool = True) -> dict:
    """Validate everything, then collect (on Ray Data, or in this process with use_ray=False). Returns the
    closing summary."""
    t_start = time.perf_counter()
    _check_output_dir(cfg.output_dir)
    contract = check_pair(cfg)                               # incompatible drafter / missing models: fail now
    files = list_input_files(cfg.inputs)
    records = read_records(files)                            # unreadable input: fail now
    tok = load_tokenizer(cfg.target)
    samples, skipped = tokenize(records, tok, prompt_field=cfg.prompt_field, response=cfg.response,
                                max_prompt_tokens=cfg.max_prompt_tokens, limit=cfg.limit,
                                prompt_turn=cfg.prompt_turn, max_response_tokens=cfg.max_response_tokens)
    data_hash = cfg.data_hash() + "-" + fingerprint(files)[:6]
    os.makedirs(cfg.output_dir, exist_ok=True)
    stale = remove_temp_files(cfg.output_dir)               # left by a killed run (atomic writes never finished)
    if stale:
        log.info("removed %d unfinished temp files of an interrupted run from %s", stale, cfg.output_dir)
    header = {"schema_version": contract.shard_schema_version, "contract": contract.to_dict(),
              "config_hash": data_hash, "config": cfg.to_dict(), "provenance": provenance(),
              "mode": "text_only" if cfg.text_only else "anchors", "inputs": files}
    manifest = Manifest(os.path.join(cfg.output_dir, "manifest.json"), header)
    manifest.data["skipped"] = dict(skipped)
    work, done = plan(cfg, samples, manifest, data_hash)
    manifest.save()                                          # from here on it lists intact shards only
    atomic_write_json(os.path.join(cfg.output_dir, "collect_config.json"), {**cfg.to_dict(), "hash": data_hash})
    log.info("%d usable samples (%d skipped: %s); %d shards to write, %d already done", len(samples),
             sum(skipped.values()), dict(skipped), len(work), done)
    returned, stalled = set(), None

    def record(row: dict) -> None:
        returned.add(row["name"])
        if row["error"]:
            log.error("%s failed: %s", row["name"], row["error"])
            manifest.fail(row["name"], row["error"])
        else:
            manifest.add(row["name"], json.loads(row["facts"]))

    if work and not use_ray:
        from tqdm.auto import tqdm

        from pipelines.collect.job import iter_inline
        for row in tqdm(iter_inline(cfg, contract.to_dict(), work), total=len(work), desc="shards", unit="shard",
                        disable=not progress):
            record(row)
    elif work:
        import ray
        from tqdm.auto import tqdm

        from pipelines.collect.job import build_dataset, quiet_ray_data_logs
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True, logging_level=logging.WARNING)
        quiet_ray_data_logs()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False                     # our own bar counts shards
        ctx.print_on_execution_start = False
        ctx.max_errored_blocks = -1                          # a shard that fails after Ray's retries: the rest go on
        ds = build_dataset(cfg, contract.to_dict(), work)
        with tqdm(total=len(work), desc="shards", unit="shard", disable=not progress) as bar:
            try:
                for row in rows_until_stall(ds.iter_rows(), cfg.stall_seconds):
                    record(row)
                    bar.update(1)
            except Stalled as e:
                stalled = str(e)
                log.error("%s: stopping; the %d shards still out are recorded as failed", e,
                          len(work) - len(returned))
                ray.shutdown()
    for item in work:
        if item["name"] not in returned:                     # its Ray task failed on every retry, or it stalled
            manifest.fail(item["name"], stalled or f"no result after {1 + cfg.shard_retries} attempts: its Ray "
                                                   f"actor died (out of memory or a crash: see the Ray logs)")
    manifest.finish([item["name"] for item in work])
    return summarize(manifest, time.perf_counter() - t_start)


class Stalled(RuntimeError):
    """No row arrived within the stall limit."""


def rows_until_stall(rows, seconds: float):
    """Yield the rows of `rows` (an iterator that may block) as they arrive; raise Stalled when none arrives for
    `seconds`. The iterator runs in a daemon thread, so a hung one (a Ray Data pool that lost an actor) cannot hold
    the job; its exceptions are raised here."""
    q: queue.Queue = queue.Queue(maxsize=1)
    done = object()

    def pump():
        try:
            for row in rows:
                q.put((row, None))
            q.put((done, None))
        except BaseException as e:                           # handed to the caller
            q.put((done, e))

    threading.Thread(target=pump, name="collect-rows", daemon=True).start()
    while True:
        try:
            row, error = q.get(timeout=seconds)
        except queue.Empty:
            raise Stalled(f"no shard finished in {seconds:g} s (stall_seconds)") from None
        if error is not None:
            raise error
        if row is done:
            return
        yield row


def _check_output_dir(path: str) -> None:
    """A Ray job submitted with --working-dir runs in a temporary copy of that folder: a relative output_dir would
    land in the copy and vanish with it (and on a multi-node cluster, output_dir must be shared storage anyway)."""
    try:
        runtime_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    except ValueError:
        runtime_env = {}
    if runtime_env.get("working_dir") and not os.path.isabs(path):
        raise ValueError(f"output_dir {path!r} is relative, but this Ray job runs in a temporary copy of its "
                         f"working dir ({os.getcwd()}), which Ray deletes once unused: give an absolute path")


def summarize(manifest: Manifest, seconds: float) -> dict:
    shards = manifest.data["shards"].values()
    rows, size = sum(s["rows"] for s in shards), sum(s["bytes"] for s in shards)
    toks = sum(s.get("new_tokens", 0) for s in shards)
    seq_toks = sum(s.get("sequence_tokens", 0) for s in shards)
    roll = sum(s.get("rollout_seconds", 0.0) for s in shards)
    feat = sum(s.get("featurize_seconds", 0.0) for s in shards)
    return {"shards": len(manifest.data["shards"]), "rows": rows, "bytes": size,
            "bytes_per_row": size / max(1, rows), "bytes_per_response_token": size / max(1, toks),
            "response_tokens": toks, "sequence_tokens": seq_toks, "rollout_tokens_per_s": toks / roll if roll else None,
            "rows_per_s_featurize": rows / feat if feat else None, "wall_seconds": round(seconds, 2),
            "skipped": manifest.data["skipped"], "failed": manifest.data["failed"],
            "complete": manifest.data["complete"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.collect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML or JSON file with the CollectConfig fields")
    ap.add_argument("--output-dir", help="override config.output_dir")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-ray", action="store_true",
                    help="run the stages in this process without Ray (small jobs; the output is the same)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = CollectConfig.load(args.config)
        if args.output_dir:
            cfg.output_dir = args.output_dir
        summary = run(cfg, progress=not args.no_progress, use_ray=not args.no_ray)
    except (ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    print(json.dumps(summary, indent=2))
    if summary["failed"]:
        log.error("%d shards failed: %s; the others are done. Run the same command again to retry the failed ones",
                  len(summary["failed"]), ", ".join(sorted(summary["failed"])))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
