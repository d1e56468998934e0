"""Step-exact checkpoints of a DeepSpeed run: DeepSpeed's own files (weights, optimizer, scheduler) under
checkpoints/step-XXXXXXXX/, each rank's RNG state beside them (safetensors), then, once every rank has finished
writing, step-XXXXXXXX/complete.json and checkpoints/latest.json (atomically, in that order): a checkpoint counts
only with its complete.json. The last `keep_last` complete ones and the best one (by simulated acceptance) are
kept; folders an interrupted save left (no complete.json, or a step past the one latest.json names) are removed.

The data position needs no saving: the batch order is a pure function of (seed, step) (see data.BatchOrder).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tfm_runtime.io import atomic_write_json

LATEST = "latest.json"
COMPLETE = "complete.json"


def tag(step: int) -> str:
    return f"step-{step:08d}"


def _steps(folder: str) -> list[int]:
    return sorted(int(d[5:]) for d in os.listdir(folder) if d.startswith("step-") and d[5:].isdigit())


def _complete(folder: str, step: int) -> bool:
    return os.path.isfile(os.path.join(folder, tag(step), COMPLETE))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def save(engine, folder: str, step: int, client_state: dict, *, keep_last: int, keep: set[int]) -> None:
    """Every rank calls this. `keep`: steps never pruned (the best)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine.save_checkpoint(folder, tag=tag(step), client_state=client_state, save_latest=False)
    path = os.path.join(folder, tag(step), f"rng_rank{rank:03d}.safetensors")
    tmp = path + ".tmp"
    save_file(_rng_state(), tmp)
    os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        atomic_write_json(os.path.join(folder, tag(step), COMPLETE), {"step": step, "world_size": world})
        atomic_write_json(os.path.join(folder, LATEST), {"tag": tag(step), "step": step})
        _remove_stale(folder, step)
        for s in _steps(folder)[:-keep_last]:                      # complete checkpoints only, after _remove_stale
            if s not in keep:
                shutil.rmtree(os.path.join(folder, tag(s)), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def _remove_stale(folder: str, current: int) -> None:
    """Remove the checkpoint folders an interrupted run left: those without complete.json, and those past
    `current` (the step latest.json names), which a run killed between the two writes leaves complete."""
    for s in _steps(folder):
        if s != current and (s > current or not _complete(folder, s)):
            shutil.rmtree(os.path.join(folder, tag(s)), ignore_errors=True)


def discard_incomplete(folder: str) -> None:
    """What an interrupted run left goes before a resume (rank 0 calls this)."""
    if os.path.isdir(folder):
        info = latest(folder)
        _remove_stale(folder, info["step"] if info else -1)


def latest(folder: str) -> dict | None:
    path = os.path.join(folder, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        info = json.load(f)
    if not os.path.isdir(os.path.join(folder, info["tag"])):
        raise FileNotFoundError(f"{path} names checkpoint {info['tag']}, which is missing")
    return info


def load(engine, folder: str, info: dict) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the client state."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path, client_state = engine.load_checkpoint(folder, tag=info["tag"], load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {info['tag']} from {folder}")
    rng_path = os.path.join(folder, info["tag"], f"rng_rank{rank:03d}.safetensors")
    if not os.path.isfile(rng_path):
        raise FileNotFoundError(f"{rng_path} is missing: was the checkpoint written by a run with another world size?")
    rng = load_file(rng_path)
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    return client_state
