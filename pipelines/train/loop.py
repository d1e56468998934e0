"""The DeepSpeed training loop shared by Weaver and DFlash training.

Run folder: train_config.json (resolved config, run hash, the data's shard hashes, provenance), metrics.jsonl (one
line per logged step, per skipped step and per evaluation), tb/ (TensorBoard), checkpoints/ (step-exact resume),
best/ and final/ (safetensors models), summary.json. Re-running with the same config on the same data resumes from
checkpoints/latest.json.

A step whose loss or gradient norm is not finite is skipped by the optimizer before it touches the weights
(pipelines/train/optim.py) and counted; `max_bad_steps` of them in a row stop the run (BadSteps).
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from pipelines.provenance import provenance
from pipelines.train import checkpoint
from pipelines.train.config import TrainConfig
from pipelines.train.data import BatchOrder, data_fingerprint
from pipelines.train.optim import make_optimizer, owns_clipping
from tfm_runtime.io import atomic_write_json, atomic_write_text

log = logging.getLogger("tfm.train")


def init_distributed(device_kind: str) -> tuple[int, int, int]:
    """-> (rank, world size, local rank). A plain `python -m pipelines.train` is a world of one."""
    import deepspeed
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if "RANK" not in os.environ and not dist.is_initialized():
        # A world of one needs no rendezvous: an in-process store instead of a TCP port that another process can
        # take between choosing it and listening on it. DeepSpeed adopts the initialized group.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device_kind != "cuda":
        # DeepSpeed's CPU backend compiles a C++ shared-memory all-reduce op on first use (minutes on a fresh machine,
        # and a process killed while compiling leaves a lock that hangs every later run); gloo all-reduces CPU
        # gradients without it.
        # (importlib: the attribute deepspeed.comm.torch is the torch package that the module imports)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


class StopRequest:
    """SIGTERM or SIGUSR1 (a preempting scheduler) asks for a checkpoint at the next step boundary and an exit
    with code 143; running the same command again resumes there. Every rank agrees through the per-step
    all-reduce, so all of them stop at the same step."""

    def __init__(self):
        self.requested = False
        self.previous = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


class Stopped(Exception):
    """Raised after the checkpoint of a requested stop is written."""

    def __init__(self, step: int):
        super().__init__(f"stopped by a signal at step {step}; checkpoint saved; run the same command to resume")
        self.step = step


class BadSteps(Exception):
    """`max_bad_steps` steps in a row had a non-finite loss or gradient norm (each one skipped)."""


class MetricsLog:
    """metrics.jsonl + TensorBoard on rank 0. On resume, lines past the resumed step are dropped (they were
    written after the checkpoint by the interrupted run), and so is a torn last line (the run was killed while
    writing it); TensorBoard purges those steps too. A run that starts at step 0 (no checkpoint) keeps none: it
    evaluates step 0 again."""

    def __init__(self, run_dir: str, resume_step: int, enabled: bool):
        self.enabled, self.path = enabled, os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        if os.path.isfile(self.path):
            with open(self.path) as f:
                lines = [(n, ln) for n, ln in enumerate(f.read().splitlines(), 1) if ln.strip()]
            keep = []
            for n, ln in lines:
                try:
                    record = json.loads(ln)
                except ValueError:
                    if n != lines[-1][0]:
                        raise ValueError(f"{self.path} line {n} is not valid JSON: {ln[:80]!r}") from None
                    log.warning("%s: dropping its torn last line %d (the run was killed while writing it)",
                                self.path, n)
                    break
                if resume_step and record["step"] <= resume_step:
                    keep.append(ln + "\n")
            atomic_write_text(self.path, "".join(keep))
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=resume_step + 1 if resume_step else 0)
        except ImportError:                                  # tensorboard is optional
            log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self.tb:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb:
            self.tb.close()


def remove_temp_files(run_dir: str) -> int:
    """Delete the temp files of atomic writes (train_config.json, metrics.jsonl, summary.json, latest.json, the
    best/ and final/ files) that a killed run left in `run_dir` -> count. (Temp files inside a checkpoint folder go
    with the folder: checkpoint.discard_incomplete.)"""
    import glob
    stale = [p for sub in ("", "checkpoints", "best", "final")
             for p in glob.glob(os.path.join(glob.escape(os.path.join(run_dir, sub)), ".*.tmp"))]
    for p in stale:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return len(stale)


def run_record(cfg: TrainConfig, fingerprint: str, shards: dict) -> dict:
    """train_config.json: the resolved config, the run hash and the data it covers (shard hashes), provenance."""
    return {**cfg.to_dict(), "run_hash": cfg.run_hash(fingerprint), "data_fingerprint": fingerprint,
            "data_shards": shards, "provenance": provenance()}


def check_run_dir(cfg: TrainConfig, fingerprint: str, shards: dict) -> None:
    """A run folder resumes only a run of the same trajectory settings on the same shards; a refusal names what
    changed (`fingerprint`, `shards`: data.data_fingerprint of cfg.data)."""
    path = os.path.join(cfg.output_dir, "train_config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        old = json.load(f)
    new_hash = cfg.run_hash(fingerprint)
    if old.get("run_hash") == new_hash:
        return
    changes = [f"{k} {old[k]!r} -> {v!r}" for k, v in cfg.trajectory_settings().items() if k in old and old[k] != v]
    if "data_shards" not in old:
        changes.append("the run's data is not recorded")
    else:
        for folder in sorted(set(old["data_shards"]) | set(shards)):
            a, b = old["data_shards"].get(folder, {}), shards.get(folder, {})
            diff = [f"{n} added" for n in sorted(set(b) - set(a))] + \
                   [f"{n} removed" for n in sorted(set(a) - set(b))] + \
                   [f"{n} changed" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
            if diff:
                changes.append(f"data {folder}: {', '.join(diff)}")
    raise ValueError(f"{cfg.output_dir} holds a run with another config (hash {old.get('run_hash')}, this one "
                     f"{new_hash}): {'; '.join(changes) or 'settings of an older version'}; choose a new output_dir "
                     f"to start a new run")


def build_task(cfg: TrainConfig, device, dtype):
    if cfg.model == "weaver":
        from pipelines.train.weaver_task import WeaverTask
        return WeaverTask(cfg, device, dtype)
    from pipelines.train.dflash_task import DFlashTask
    return DFlashTask(cfg, device, dtype)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run (or resume) the training run `cfg` describes; -> summary. Raises Stopped after a signal's checkpoint."""
    return Trainer(cfg).run(progress)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        import deepspeed
        self.cfg = cfg
        want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.rank, self.world, local_rank = init_distributed("cuda" if want_cuda else "cpu")
        self.device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and want_cuda)
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.data_fingerprint, data_shards = data_fingerprint(cfg.data)
        self.run_hash = cfg.run_hash(self.data_fingerprint)
        check_run_dir(cfg, self.data_fingerprint, data_shards)
        # rank 0 builds the datasets cache first; the others then read it
        task = build_task(cfg, self.device, dtype) if self.rank == 0 else None
        self.barrier()
        self.task = task or build_task(cfg, self.device, dtype)
        self.order = BatchOrder(len(self.task.train_index), micro=cfg.micro_batch, accum=cfg.grad_accum,
                                world=self.world, seed=cfg.seed)
        if self.rank == 0:                                       # data and models are fine: the run starts here
            os.makedirs(cfg.output_dir, exist_ok=True)
            atomic_write_json(os.path.join(cfg.output_dir, "train_config.json"),
                              run_record(cfg, self.data_fingerprint, data_shards))
        if cfg.compile == "on" or (cfg.compile == "auto" and want_cuda and cfg.model == "weaver"):
            # fuses the elementwise tail of the step
            self.task.objective.forward = torch.compile(self.task.objective.forward)
            if self.rank == 0:
                log.info("torch.compile: the objective's forward is compiled (compile: %s)", cfg.compile)
        params = [p for p in self.task.objective.parameters() if p.requires_grad]
        opt = make_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                             zero_stage=cfg.zero_stage, device=self.device)
        self.opt = opt
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        self.engine, _, _, _ = deepspeed.initialize(model=self.task.objective, optimizer=opt, lr_scheduler=self.sched,
                                                    config=cfg.deepspeed_config(self.world, bf16),
                                                    dist_init_required=False)
        self.ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
        self.start, self.best = 0, {"score": -math.inf, "step": None}
        self.skipped_steps, self.bad_in_a_row = 0, 0             # non-finite steps: in all, and the current run
        if self.rank == 0:                                       # what a killed run left
            remove_temp_files(cfg.output_dir)
            checkpoint.discard_incomplete(self.ckpt_dir)
        self.barrier()
        info = checkpoint.latest(self.ckpt_dir)
        if info:
            client = checkpoint.load(self.engine, self.ckpt_dir, info)
            self.start, self.best = int(client["step"]), client["best"]
            self.skipped_steps, self.bad_in_a_row = client["skips"]["total"], client["skips"]["in_a_row"]
            if self.rank == 0:
                log.info("resumed from %s (step %d of %d)", info["tag"], self.start, cfg.steps)
        self.metrics = MetricsLog(cfg.output_dir, self.start, self.rank == 0)
        self._pending = None             # (done, [loss sum, stop requests], grad norm, skipped) not yet read back

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def run(self, progress: bool) -> dict:
        from tqdm.auto import tqdm
        cfg = self.cfg
        if self.start == 0:
            self.evaluate(0)
        self.engine.module.train()
        t_run, items = time.perf_counter(), 0
        self._log_at = (self.start, t_run)                   # (step, time) of the last metrics line
        self.bar = tqdm(total=cfg.steps, initial=self.start, desc=f"train {self.task.name}",
                        disable=not (progress and self.rank == 0))
        stop = StopRequest()
        try:
            for step in range(self.start, cfg.steps):
                requested = self.step(step, stop.requested)
                items += self.order.global_batch
                if requested and step + 1 < cfg.steps:
                    if (step + 1) % cfg.checkpoint_every:
                        self.save(step + 1)
                    raise Stopped(step + 1)
        finally:
            stop.restore()
            self.bar.close()
            self.metrics.close()
        seconds = time.perf_counter() - t_run
        summary = {"steps": cfg.steps, "resumed_from": self.start, "best": self.best, "world_size": self.world,
                   "skipped_steps": self.skipped_steps, "items_per_s": items / seconds if items else None,
                   "seconds": round(seconds, 2)}
        if self.rank == 0:
            self.task.save_model(self.engine.module, os.path.join(cfg.output_dir, "final"), cfg.steps, None)
            atomic_write_json(os.path.join(cfg.output_dir, "summary.json"), summary)
        self.barrier()
        return summary

    def step(self, step: int, stop_requested: bool) -> bool:
        """Optimizer step `step` (grad_accum micro steps), then logging, evaluation and checkpoints as due.
        Returns whether any rank was asked to stop (known one step late, see `_finish`)."""
        cfg, engine = self.cfg, self.engine
        total = torch.zeros(2, device=self.device)                         # [loss sum, stop requests]
        for m in range(cfg.grad_accum):
            batch = self.task.batch(self.order.indices(step, m, self.rank), step, m, self.rank)
            loss, _ = engine(batch)
            engine.backward(loss)
            total[0] += loss.detach().float()
            if m == cfg.grad_accum - 1:
                self.opt.loss = total[0]          # checked with the gradient norm before the update (optim.py)
            engine.step()
        total[1] = float(stop_requested)
        if dist.is_initialized():
            dist.all_reduce(total)
        done = step + 1
        # the gradient norm before clipping, a device tensor (None where DeepSpeed clips and clipping is off)
        gn = self.opt.grad_norm if owns_clipping(cfg.zero_stage) else engine.get_global_grad_norm()
        this = (done, total, gn, self.opt.skipped)
        # the previous step's numbers are read only now, with this step already queued: a read-back here
        # would leave the GPU idle while the host prepares the next batch
        requested = self._finish() if self._pending else False
        self._pending = this
        if done % cfg.log_every == 0 or done % cfg.eval_every == 0 or done % cfg.checkpoint_every == 0 \
                or done == cfg.steps:
            requested |= self._finish()
        if done % cfg.eval_every == 0 or done == cfg.steps:
            self.evaluate(done)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            self.save(done)
        return requested

    def _finish(self) -> bool:
        """Read back the pending step's loss, gradient norm, skip flag and stop flag (the one host sync of a step),
        count a skipped step (and stop after `max_bad_steps` in a row), update the progress bar and log as due.
        -> whether any rank asked to stop."""
        (done, total, gn, skipped), self._pending = self._pending, None
        total = total.tolist()
        loss_mean = total[0] / (self.cfg.grad_accum * self.world)
        gn = float(gn) if gn is not None else None
        self.bar.update(1)
        if skipped is not None and bool(skipped):
            self.skipped_steps += 1
            self.bad_in_a_row += 1
            log.warning("step %d skipped: loss %s, gradient norm %s (%d in a row)", done, loss_mean, gn,
                        self.bad_in_a_row)
            self.metrics.write("skipped", done, {"loss": str(loss_mean), "grad_norm": str(gn),
                                                 "skipped_steps": self.skipped_steps})
            if self.bad_in_a_row >= self.cfg.max_bad_steps:
                raise BadSteps(self._bad_steps_message(done, loss_mean, gn))
            return total[1] > 0
        self.bad_in_a_row = 0
        self.bar.set_postfix(loss=f"{loss_mean:.4f}")
        if done % self.cfg.log_every == 0 or done == self.cfg.steps:
            # wall seconds per step since the last line (evaluations and checkpoints in between included)
            (last, t), now = self._log_at, time.perf_counter()
            self._log_at = (done, now)
            self.metrics.write("train", done, {"loss": loss_mean, "lr": self.sched.get_last_lr()[0],
                                               "grad_norm": gn, "skipped_steps": self.skipped_steps,
                                               "step_seconds": (now - t) / max(1, done - last)})
        return total[1] > 0

    def _bad_steps_message(self, done: int, loss: float, gn: float | None) -> str:
        positions = np.concatenate([self.order.indices(done - 1, m, r) for m in range(self.cfg.grad_accum)
                                    for r in range(self.world)])
        rows = self.task.data.locate(self.task.train_index[positions])
        info = checkpoint.latest(self.ckpt_dir)
        return (f"step {done}: {self.bad_in_a_row} consecutive steps with a non-finite loss or gradient norm, all "
                f"skipped (max_bad_steps {self.cfg.max_bad_steps}; this one: loss {loss}, gradient norm {gn}); "
                f"stopping without a checkpoint (the last one, {info['tag'] if info else 'none yet'}, is intact). "
                f"The rows of step {done}: " + "; ".join(f"{f} rows {r}" for f, r in rows.items()))

    def evaluate(self, step: int) -> None:
        if self.rank == 0:
            module = self.engine.module
            module.eval()
            ev = self.task.evaluate(module)
            module.train()
            self.metrics.write("eval", step, ev)
            log.info("step %d eval: %s", step, {k: v for k, v in ev.items() if not isinstance(v, list)})
            if ev["score"] > self.best["score"]:
                self.best.update(score=ev["score"], step=step)
                self.task.save_model(module, os.path.join(self.cfg.output_dir, "best"), step, ev)
        self.barrier()

    def save(self, done: int) -> None:
        if self._pending:                    # a checkpoint only after its step's loss and gradient norm are checked
            self._finish()
        keep = {self.best["step"]} if self.best["step"] is not None else set()
        # (DeepSpeed's own checkpoint keys include "skipped_steps": ours are under "skips")
        skips = {"total": self.skipped_steps, "in_a_row": self.bad_in_a_row}
        checkpoint.save(self.engine, self.ckpt_dir, done, {"step": done, "best": self.best, "run_hash": self.run_hash,
                                                           "skips": skips},
                        keep_last=self.cfg.keep_last, keep=keep)
