"""Fault injection for the pipelines: collect and train are killed (SIGKILL) at random points, in the middle of
shard, manifest, checkpoint, model and metrics writes too, then resumed; every final output must equal an
uninterrupted run's, and no partial file may be left.

  python -m benchmarks.pipelines.fault_injection              # 20 kills per stage -> fault_injection_cpu.json
  python -m benchmarks.pipelines.fault_injection --kills 2 --out /tmp/fi.json

How the kills land. Every run is a child process forked from this one after the heavy imports, so it starts at once
(collect with --no-ray, train as one process, on the tiny world). Half of the kills come at a random time within an
uninterrupted run's duration: this process SIGKILLs the child. The other half target a write: the child wraps the
functions that write (os.replace, torch.save, safetensors' save_file and the trainer's metrics writer) and at the
chosen call leaves the file as a kill mid-write would (torn at half its bytes, or written but not renamed), then
SIGKILLs itself. The wrappers live in this file: the pipelines' code has no test hooks.

Training on the CPU never loads DeepSpeed's JIT-compiled shared-memory op (pipelines.train.loop.init_distributed),
so a kill cannot leave its build lock behind to hang the next start.

"Identical": collect, the same shard files byte for byte (sha256) and the same manifest.json and
collect_config.json apart from provenance, output_dir and timings; train, the same final/ and best/ files bit for
bit, the same metrics.jsonl apart from step_seconds, and the same checkpoints kept. "Partial files": temp files of
atomic writes (*.tmp) anywhere, checkpoint folders without complete.json, a torn last line of metrics.jsonl, a
torn TensorBoard record, datasets' *.incomplete folders, unlisted or unexpected files in collect's output.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import signal
import struct
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "benchmarks", "results", "fault_injection_cpu.json")
# The write each targeted kill interrupts, and the state it leaves.
WRITES = {
    "collect": {"shard_write": "a shard's temp file, torn at half its bytes (not yet renamed)",
                "shard_renamed": "a shard renamed into place, not yet in the manifest",
                "manifest_write": "the manifest's temp file, torn at half its bytes (not yet renamed)"},
    "train": {"checkpoint_file": "a DeepSpeed checkpoint file (model or optimizer states), torn at half its bytes",
              "rng_file": "a rank's RNG-state temp file in a checkpoint, torn at half its bytes",
              "checkpoint_marker": "a checkpoint's complete.json, all its files written, not yet renamed",
              "latest_json": "checkpoints/latest.json, the checkpoint complete, not yet renamed",
              "metrics_line": "a metrics.jsonl line, torn at half",
              "model_file": "a best/ or final/ model.safetensors temp file, torn at half its bytes"}}
PROMPTS = 12
COLLECT = {"target": "tiny:llama:0", "drafter": "tiny:llama:0", "max_new_tokens": 12, "anchors_per_sequence": 3,
           "candidate_pool": 16, "target_topk": 4, "samples_per_shard": 2, "max_prompt_tokens": 64}
TRAIN = {"d_rank": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64, "steps": 12, "micro_batch": 4,
         "lr": 3e-3, "warmup_steps": 2, "heldout_fraction": 0.15, "eval_every": 6, "eval_rows": 8,
         "eval_budgets": [4], "checkpoint_every": 3, "keep_last": 1, "log_every": 1, "precision": "fp32"}


# ---- in the child: the write wrappers -------------------------------------------------------------------------------
class KillAt:
    """Counts the writes of each kind; at the `index`-th write of `kind` (1-based) leaves it torn and dies."""

    def __init__(self, kind: str | None, index: int | None):
        self.kind, self.index, self.counts = kind, index, {}

    def due(self, kind: str) -> bool:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return kind == self.kind and self.counts[kind] == self.index

    def install(self, stage: str) -> None:
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            name = os.path.basename(os.fspath(dst))
            if stage == "collect" and name.endswith(".parquet"):
                if self.due("shard_write"):
                    die(torn=src)
                real_replace(src, dst, *a, **kw)
                if self.due("shard_renamed"):
                    die()
                return None
            kind = {("collect", "manifest.json"): "manifest_write", ("train", "complete.json"): "checkpoint_marker",
                    ("train", "latest.json"): "latest_json"}.get((stage, name))
            if kind and self.due(kind):
                die(torn=src if kind == "manifest_write" else None)
            return real_replace(src, dst, *a, **kw)

        os.replace = replace
        if stage == "train":
            self._install_train()

    def _install_train(self) -> None:
        import io

        import safetensors.torch
        import torch

        import pipelines.train.checkpoint as checkpoint
        from pipelines.train.loop import MetricsLog
        real_save, real_save_file, real_write = torch.save, safetensors.torch.save_file, MetricsLog.write

        def save(obj, f, *a, **kw):
            if isinstance(f, str) and f"{os.sep}checkpoints{os.sep}step-" in f and self.due("checkpoint_file"):
                buf = io.BytesIO()
                real_save(obj, buf, *a, **kw)
                with open(f, "wb") as out:
                    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                die()
            return real_save(obj, f, *a, **kw)

        def save_file_as(kind):
            def save_file(tensors, path, *a, **kw):
                real_save_file(tensors, path, *a, **kw)
                if self.due(kind):
                    die(torn=path)
            return save_file

        def write(log, kind, step, values):
            if log.enabled and self.due("metrics_line"):
                line = json.dumps({"kind": kind, "step": step, **values}) + "\n"
                with open(log.path, "a") as f:
                    f.write(line[: len(line) // 2])
                die()
            return real_write(log, kind, step, values)

        torch.save = save
        checkpoint.save_file = save_file_as("rng_file")               # the RNG state (imported by name there)
        safetensors.torch.save_file = save_file_as("model_file")      # best/ and final/ (imported at each call)
        MetricsLog.write = write


def die(torn: str | None = None) -> None:
    """SIGKILL this process, first cutting `torn` to half its bytes (a write the kill interrupted)."""
    if torn:
        with open(torn, "r+b") as f:
            f.truncate(os.path.getsize(torn) // 2)
    sys.stdout.flush(), sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def child(stage: str, argv: list[str], kill: tuple[str, int] | None, log_path: str, counts_path: str | None):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    import torch
    torch.set_num_threads(1)
    k = KillAt(*(kill or (None, None)))
    k.install(stage)
    if stage == "collect":
        from pipelines.collect.__main__ import main
    else:
        from pipelines.train.__main__ import main
    try:
        rc = main(argv)
    except BaseException:                                              # noqa: BLE001 (reported by exit code and log)
        import traceback
        traceback.print_exc()
        rc = 1
    if counts_path:
        with open(counts_path, "w") as f:
            json.dump(k.counts, f)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(rc)


def run_child(stage: str, argv: list[str], log_path: str, *, kill: tuple[str, int] | None = None,
              kill_after: float | None = None, counts_path: str | None = None) -> tuple[int, float]:
    """Fork a child that runs the stage's main(argv); SIGKILL it after `kill_after` seconds if still running.
    -> (exit code, negative for a signal; seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(stage, argv, kill, log_path, counts_path)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - t0
        if kill_after is not None and time.monotonic() - t0 >= kill_after:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), time.monotonic() - t0
        time.sleep(0.005)


# ---- checks ---------------------------------------------------------------------------------------------------------
def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def torn_tfrecord(path: str) -> bool:
    """Whether a TensorBoard event file ends inside a record (length u64, crc u32, data, crc u32)."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            return True
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        pos += 12 + n + 4
    return pos != len(data)


def partial_files(stage: str, out: str) -> list[str]:
    """What a kill can leave half-done in an output folder (see the module docstring)."""
    found = []
    if not os.path.isdir(out):
        return found
    for root, dirs, files in os.walk(out):
        rel = os.path.relpath(root, out)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".tmp")]
        found += [os.path.normpath(os.path.join(rel, d)) for d in dirs if d.endswith(".incomplete")]
        if stage == "train" and os.path.basename(root) == "checkpoints":
            found += [f"checkpoints/{d} (no complete.json)" for d in dirs
                      if d.startswith("step-") and not os.path.isfile(os.path.join(root, d, "complete.json"))]
        if stage == "train" and os.path.basename(root) == "tb":
            found += [f"tb/{f} (torn record)" for f in files if torn_tfrecord(os.path.join(root, f))]
    if stage == "collect":
        listed = set(load_json(os.path.join(out, "manifest.json"))["shards"]) \
            if os.path.isfile(os.path.join(out, "manifest.json")) else set()
        found += [f"{f} (not in the manifest)" for f in os.listdir(out) if f.endswith(".parquet") and f not in listed]
    metrics = os.path.join(out, "metrics.jsonl")
    if stage == "train" and os.path.isfile(metrics):
        with open(metrics) as f:
            text = f.read()
        if text and not text.endswith("\n"):
            found.append("metrics.jsonl (torn last line)")
    return sorted(found)


def in_flight(stage: str, out: str) -> list[str]:
    """Right after a kill: the partial files, and how far the run had got."""
    found = partial_files(stage, out)
    if stage == "collect" and os.path.isfile(os.path.join(out, "manifest.json")):
        m = load_json(os.path.join(out, "manifest.json"))
        found.append(f"{len(m['shards'])} shards listed, complete: {m.get('complete')}")
    if stage == "train":
        latest = os.path.join(out, "checkpoints", "latest.json")
        found.append(f"latest checkpoint: {load_json(latest)['tag'] if os.path.isfile(latest) else 'none'}")
    return found


def normalized_manifest(out: str) -> dict:
    m = load_json(os.path.join(out, "manifest.json"))
    m.pop("provenance")
    m["config"].pop("output_dir")
    for facts in m["shards"].values():
        facts.pop("rollout_seconds"), facts.pop("featurize_seconds")
    return m


def differences(stage: str, ref: str, out: str) -> list[str]:
    """How `out` differs from the uninterrupted run's `ref` (empty: identical in the sense of the docstring)."""
    diff = []
    if stage == "collect":
        want = {n: sha256(os.path.join(ref, n)) for n in os.listdir(ref) if n.endswith(".parquet")}
        got = {n: sha256(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".parquet")}
        diff += [f"{n}: sha256 differs or missing" for n in sorted(want) if got.get(n) != want[n]]
        diff += [f"{n}: not in the uninterrupted run" for n in sorted(set(got) - set(want))]
        if not os.path.isfile(os.path.join(out, "manifest.json")):
            return diff + ["manifest.json missing"]
        if normalized_manifest(out) != normalized_manifest(ref):
            diff.append("manifest.json differs")
        a, b = load_json(os.path.join(ref, "collect_config.json")), load_json(os.path.join(out, "collect_config.json"))
        if {**a, "output_dir": None} != {**b, "output_dir": None}:
            diff.append("collect_config.json differs")
        extra = set(os.listdir(out)) - set(want) - {"manifest.json", "collect_config.json"}
        diff += [f"{n}: unexpected file" for n in sorted(extra)]
        return diff
    for folder in ("final", "best"):
        a, b = os.path.join(ref, folder), os.path.join(out, folder)
        if not os.path.isdir(b):
            diff.append(f"{folder}/ missing")
            continue
        want = {n: sha256(os.path.join(a, n)) for n in os.listdir(a)}
        got = {n: sha256(os.path.join(b, n)) for n in os.listdir(b)}
        diff += [f"{folder}/{n}: differs" for n in sorted(set(want) | set(got)) if want.get(n) != got.get(n)]

    def metrics(run):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return [{k: v for k, v in json.loads(ln).items() if k != "step_seconds"} for ln in f if ln.strip()]

    if metrics(ref) != metrics(out):
        diff.append("metrics.jsonl differs")

    def checkpoints(run):
        return sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step-"))

    if checkpoints(ref) != checkpoints(out):
        diff.append(f"checkpoints {checkpoints(out)}, uninterrupted {checkpoints(ref)}")
    sa, sb = load_json(os.path.join(ref, "summary.json")), load_json(os.path.join(out, "summary.json"))
    if (sa["best"], sa["skipped_steps"]) != (sb["best"], sb["skipped_steps"]):
        diff.append("summary.json best or skipped_steps differ")
    return diff


# ---- the experiment -------------------------------------------------------------------------------------------------
def env_block() -> dict:
    import importlib.metadata
    import platform
    import subprocess
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        rev, dirty = None, None
    versions = {}
    for name in ("torch", "transformers", "ray", "deepspeed", "datasets", "pyarrow", "safetensors"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return {"git_revision": rev, "dirty": dirty, "gpu": None, "driver": None, "versions": versions,
            "command": shlex.join(["python", "-m", "benchmarks.pipelines.fault_injection"] + sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def preload() -> None:
    """The imports every child needs (also the ones done lazily at run time), done once here: a forked child
    starts with them. Nothing is run: no threads or devices are started before the fork."""
    import importlib
    for name in ("pipelines.collect.__main__", "pipelines.collect.job", "pipelines.collect.rollout",
                 "pipelines.train.__main__", "pipelines.train.loop", "pipelines.train.weaver_task",
                 "pipelines.train.evaluate", "transformers.models.llama.modeling_llama",
                 "datasets.packaged_modules.parquet.parquet", "deepspeed.runtime.zero.muon.muon_optimizer",
                 "deepspeed.runtime.zero.stage_1_and_2", "torch.utils.tensorboard"):
        importlib.import_module(name)


def stage_argv(stage: str, config: str, out: str) -> list[str]:
    extra = ["--no-ray"] if stage == "collect" else []
    return ["--config", config, "--output-dir", out, "--no-progress", *extra]


def kill_plan(stage: str, kills: int, seconds: float, counts: dict, rng: random.Random) -> list[dict]:
    """Even rows: a random time in [5%, 70%] of the uninterrupted run; odd rows: the writes, kind by kind, each at
    a random one of its calls in the uninterrupted run."""
    kinds = [k for k in WRITES[stage] if counts.get(k)]
    plan = []
    for i in range(kills):
        if i % 2 == 0 or not kinds:
            plan.append({"at": round(rng.uniform(0.05, 0.7) * seconds, 2)})
        else:
            kind = kinds[(i // 2) % len(kinds)]
            plan.append({"write": kind, "index": rng.randint(1, counts[kind])})
    return plan


def run_stage(stage: str, work: str, config: str, kills: int, rng: random.Random) -> tuple[dict, list[dict]]:
    ref = os.path.join(work, stage, "reference")
    logs = os.path.join(work, stage, "logs")
    os.makedirs(logs)
    counts_path = os.path.join(logs, "reference_counts.json")
    rc, seconds = run_child(stage, stage_argv(stage, config, ref), os.path.join(logs, "reference.log"),
                            counts_path=counts_path)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted {stage} run failed ({rc}): see {logs}/reference.log")
    counts = load_json(counts_path)
    print(f"{stage}: uninterrupted run {seconds:.1f} s, writes {counts}", flush=True)
    rows = []
    for i, point in enumerate(kill_plan(stage, kills, seconds, counts, rng)):
        out = os.path.join(work, stage, f"run{i:02d}")
        log = os.path.join(logs, f"run{i:02d}.log")
        if "write" in point:
            rc, t = run_child(stage, stage_argv(stage, config, out), log, kill=(point["write"], point["index"]))
            kill_point = f"write {point['write']} #{point['index']} of {counts[point['write']]}"
            writing = WRITES[stage][point["write"]]
        else:
            rc, t = run_child(stage, stage_argv(stage, config, out), log, kill_after=point["at"])
            kill_point = f"t = {point['at']} s of {seconds:.1f}"
            writing = None
        killed = rc == -signal.SIGKILL
        left = in_flight(stage, out)
        rc2, t2 = run_child(stage, stage_argv(stage, config, out), log)
        diff = differences(stage, ref, out) if rc2 == 0 else ["the resumed run failed"]
        row = {"stage": stage, "kill_point": kill_point,
               "writing": writing or "; ".join(left) or "nothing (the run had not written yet)",
               "killed": killed, "after_kill": left, "resumed_ok": rc2 == 0, "identical": not diff,
               "partial_files_left": partial_files(stage, out), "differences": diff,
               "seconds": [round(t, 2), round(t2, 2)]}
        rows.append(row)
        print(f"{stage} {i:2d}: {kill_point:32s} killed {killed}, resumed {rc2 == 0}, identical {not diff}, "
              f"left {row['partial_files_left']} {diff or ''}", flush=True)
    return {"seconds": round(seconds, 2), "writes": counts}, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipelines.fault_injection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="killed runs per stage (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", nargs="+", choices=["collect", "train"], default=["collect", "train"],
                    help="train needs collect (its data is collect's uninterrupted output)")
    ap.add_argument("--out", default=OUT, help="results file (JSON)")
    ap.add_argument("--workdir", help="keep the runs here (default: a temporary folder, removed at the end)")
    args = ap.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        os.environ.pop(k, None)
    t0 = time.monotonic()
    preload()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tfm-faults-") as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        with open(os.path.join(work, "prompts.jsonl"), "w") as f:
            for i in range(PROMPTS):
                f.write(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n")
        configs = {"collect": {**COLLECT, "inputs": [os.path.join(work, "prompts.jsonl")],
                               "output_dir": os.path.join(work, "collect", "reference")},
                   "train": {**TRAIN, "data": [os.path.join(work, "collect", "reference")],
                             "output_dir": os.path.join(work, "train", "reference")}}
        reference, rows = {}, []
        for stage in ("collect", "train"):
            if stage not in args.stages:
                continue
            path = os.path.join(work, f"{stage}.json")
            with open(path, "w") as f:
                json.dump(configs[stage], f)
            reference[stage], stage_rows = run_stage(stage, work, path, args.kills, rng)
            rows += stage_rows
    totals = {stage: {"killed_runs": sum(r["killed"] for r in rows if r["stage"] == stage),
                      "targeted_writes": sum(r["kill_point"].startswith("write") for r in rows if r["stage"] == stage),
                      "resumed_ok": sum(r["resumed_ok"] for r in rows if r["stage"] == stage),
                      "identical": sum(r["identical"] for r in rows if r["stage"] == stage),
                      "with_partial_files_left": sum(bool(r["partial_files_left"]) for r in rows
                                                     if r["stage"] == stage)}
              for stage in args.stages}
    results = {"env": env_block(), "what": __doc__.split("\n\n")[0].replace("\n", " "),
               "configs": {"prompts": PROMPTS, "collect": COLLECT, "train": TRAIN, "kills_per_stage": args.kills,
                           "seed": args.seed},
               "uninterrupted": reference, "rows": rows, "totals": totals,
               "seconds": round(time.monotonic() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(results, indent=1) + "\n")
    print(json.dumps(totals, indent=1))
    bad = [r for r in rows if not (r["resumed_ok"] and r["identical"] and not r["partial_files_left"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
