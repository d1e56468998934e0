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
import socket
import time

import torch
import torch.distributed as dist

from pipelines.provenance import provenance
from pipelines.train import checkpoint
from pipelines.train.config import TrainConfig
from pipelines.train.data import BatchOrder
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
        return WeaverTask(cfg, device, dtype, cfg.output_dir)
    from pipelines.train.dflash_task import DFlashTask
    return DFlashTask(cfg, device, dtype, cfg.output_dir)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    import deepspeed
    from tqdm.auto import tqdm
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world, local_rank = init_distributed("cuda" if want_cuda else "cpu")
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and want_cuda)
    dtype = torch.bfloat16 if bf16 else torch.float32
    _check_run_dir(cfg)
    # rank 0 builds the datasets cache first; the others then read it
    task = build_task(cfg, device, dtype) if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    task = task or build_task(cfg, device, dtype)
    order = BatchOrder(len(task.train_index), micro=cfg.micro_batch, accum=cfg.grad_accum, world=world, seed=cfg.seed)
    if rank == 0:                                            # the data and models are fine: the run starts here
        os.makedirs(cfg.output_dir, exist_ok=True)
        atomic_write_json(os.path.join(cfg.output_dir, "train_config.json"),
                          {**cfg.to_dict(), "run_hash": cfg.run_hash(), "provenance": provenance()})
    params = [p for p in task.objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=task.objective, optimizer=opt, lr_scheduler=sched,
                                           config=cfg.deepspeed_config(world, bf16), dist_init_required=False)
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    start, best = 0, {"score": -math.inf, "step": None}
    info = checkpoint.latest(ckpt_dir)
    if info:
        client = checkpoint.load(engine, ckpt_dir, info)
        start, best = int(client["step"]), client["best"]
        if rank == 0:
            log.info("resumed from %s (step %d of %d)", info["tag"], start, cfg.steps)
    metrics = MetricsLog(cfg.output_dir, start, rank == 0)

    def evaluate(step: int) -> None:
        if rank == 0:
            engine.module.eval()
            ev = task.evaluate(engine.module)
            engine.module.train()
            metrics.write("eval", step, ev)
            log.info("step %d eval: %s", step, {k: v for k, v in ev.items() if not isinstance(v, list)})
            if ev["score"] > best["score"]:
                best.update(score=ev["score"], step=step)
                task.save_model(engine.module, os.path.join(cfg.output_dir, "best"), step, ev)
        if dist.is_initialized():
            dist.barrier()

    if start == 0:
        evaluate(0)
    engine.module.train()
    t_run, items = time.perf_counter(), 0
    bar = tqdm(total=cfg.steps, initial=start, desc=f"train {task.name}", disable=not (progress and rank == 0))
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for m in range(cfg.grad_accum):
            batch = task.batch(order.indices(step, m, rank), step, m, rank)
            loss, _ = engine(batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(total)
        done = step + 1
        items += order.global_batch
        loss_mean = float(total) / (cfg.grad_accum * world)
        if not math.isfinite(loss_mean):
            raise FloatingPointError(f"step {done}: loss is {loss_mean}; stopping (last checkpoint is kept)")
        bar.update(1)
        bar.set_postfix(loss=f"{loss_mean:.4f}")
        if done % cfg.log_every == 0 or done == cfg.steps:
            gn = engine.get_global_grad_norm()
            metrics.write("train", done, {"loss": loss_mean, "lr": sched.get_last_lr()[0],
                                          "grad_norm": float(gn) if gn is not None else None,
                                          "step_seconds": time.perf_counter() - t0})
        if done % cfg.eval_every == 0 or done == cfg.steps:
            evaluate(done)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            keep = {best["step"]} if best["step"] is not None else set()
            checkpoint.save(engine, ckpt_dir, done, {"step": done, "best": best, "run_hash": cfg.run_hash()},
                            keep_last=cfg.keep_last, keep=keep)
    bar.close()
    seconds = time.perf_counter() - t_run
    summary = {"steps": cfg.steps, "resumed_from": start, "best": best, "world_size": world,
               "items_per_s": items / seconds if items else None, "seconds": round(seconds, 2)}
    if rank == 0:
        task.save_model(engine.module, os.path.join(cfg.output_dir, "final"), cfg.steps, None)
        atomic_write_json(os.path.join(cfg.output_dir, "summary.json"), summary)
    metrics.close()
    if dist.is_initialized():
        dist.barrier()
    return summary
