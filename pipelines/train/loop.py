"""The DeepSpeed training loop shared by Weaver and DFlash training.

Run folder: train_config.json (resolved config, run hash, provenance), metrics.jsonl (one line per logged
step and per evaluation), tb/ (TensorBoard), checkpoints/ (step-exact resume), best/ and final/ (safetensors
models), summary.json. Re-running with the same config resumes from checkpoints/latest.json.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time

import torch
import torch.distributed as dist

from pipelines.provenance import provenance
from pipelines.train import checkpoint
from pipelines.train.config import TrainConfig
from pipelines.train.data import BatchOrder
from pipelines.train.optim import ClippedAdamW, make_optimizer
from tfm_runtime.io import atomic_write_json, atomic_write_text

log = logging.getLogger("tfm.train")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_kind: str) -> tuple[int, int, int]:
    """-> (rank, world size, local rank). A plain `python -m pipelines.train` is a world of one."""
    import deepspeed
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device_kind == "cuda" else "gloo", verbose=False)
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


class MetricsLog:
    """metrics.jsonl + TensorBoard on rank 0. On resume, lines past the resumed step are dropped (they were
    written after the checkpoint by the interrupted run) and TensorBoard purges them too."""

    def __init__(self, run_dir: str, resume_step: int, enabled: bool):
        self.enabled, self.path = enabled, os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        if os.path.isfile(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= resume_step]
            atomic_write_text(self.path, "".join(keep))
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=resume_step + 1 if resume_step else None)
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


def _check_run_dir(cfg: TrainConfig) -> None:
    """A run folder resumes only a run of the same config (same trajectory)."""
    path = os.path.join(cfg.output_dir, "train_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("run_hash") != cfg.run_hash():
            raise ValueError(f"{cfg.output_dir} holds a run with another config (hash {old.get('run_hash')}, "
                             f"this one {cfg.run_hash()}): choose a new output_dir to start a new run")


def build_task(cfg: TrainConfig, device, dtype):
    if cfg.model == "weaver":
        from pipelines.train.weaver_task import WeaverTask
        return WeaverTask(cfg, device, dtype)
    from pipelines.train.dflash_task import DFlashTask
    return DFlashTask(cfg, device, dtype)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run (or resume) the training run `cfg` describes; -> summary. Raises Stopped after a signal's checkpoint."""
    return Trainer(cfg).run(progress)


def check_finite(step: int, loss: float, grad_norm: float | None) -> None:
    """Stop on a non-finite loss or gradient norm (DeepSpeed's own per-parameter scan is off under bf16): the
    step has been applied, so the run ends here and a resume starts from the last checkpoint."""
    if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
        raise FloatingPointError(f"step {step}: loss {loss}, gradient norm {grad_norm}; stopping (the last "
                                 f"checkpoint is kept)")


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
        _check_run_dir(cfg)
        # rank 0 builds the datasets cache first; the others then read it
        task = build_task(cfg, self.device, dtype) if self.rank == 0 else None
        self.barrier()
        self.task = task or build_task(cfg, self.device, dtype)
        self.order = BatchOrder(len(self.task.train_index), micro=cfg.micro_batch, accum=cfg.grad_accum,
                                world=self.world, seed=cfg.seed)
        if self.rank == 0:                                       # data and models are fine: the run starts here
            os.makedirs(cfg.output_dir, exist_ok=True)
            atomic_write_json(os.path.join(cfg.output_dir, "train_config.json"),
                              {**cfg.to_dict(), "run_hash": cfg.run_hash(), "provenance": provenance()})
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
        info = checkpoint.latest(self.ckpt_dir)
        if info:
            client = checkpoint.load(self.engine, self.ckpt_dir, info)
            self.start, self.best = int(client["step"]), client["best"]
            if self.rank == 0:
                log.info("resumed from %s (step %d of %d)", info["tag"], self.start, cfg.steps)
        self.metrics = MetricsLog(cfg.output_dir, self.start, self.rank == 0)
        self._pending = None                     # (done, [loss sum, stop requests], grad norm) not yet read back

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
        self._last_finish = t_run
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
                   "items_per_s": items / seconds if items else None, "seconds": round(seconds, 2)}
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
            engine.step()
            total[0] += loss.detach().float()
        total[1] = float(stop_requested)
        if dist.is_initialized():
            dist.all_reduce(total)
        done = step + 1
        # the gradient norm before clipping, a device tensor (None where DeepSpeed clips and clipping is off)
        gn = self.opt.grad_norm if isinstance(self.opt, ClippedAdamW) else engine.get_global_grad_norm()
        this = (done, total, gn)
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
        """Read back the pending step's loss, gradient norm and stop flag (the one host sync of a step), stop on
        non-finite numbers, update the progress bar and log as due. -> whether any rank asked to stop."""
        (done, total, gn), self._pending = self._pending, None
        total = total.tolist()
        loss_mean = total[0] / (self.cfg.grad_accum * self.world)
        gn = float(gn) if gn is not None else None
        check_finite(done, loss_mean, gn)
        now = time.perf_counter()
        seconds, self._last_finish = now - self._last_finish, now
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss_mean:.4f}")
        if done % self.cfg.log_every == 0 or done == self.cfg.steps:
            self.metrics.write("train", done, {"loss": loss_mean, "lr": self.sched.get_last_lr()[0],
                                               "grad_norm": gn, "step_seconds": seconds})
        return total[1] > 0

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
        checkpoint.save(self.engine, self.ckpt_dir, done, {"step": done, "best": self.best,
                                                           "run_hash": self.cfg.run_hash()},
                        keep_last=self.cfg.keep_last, keep=keep)
