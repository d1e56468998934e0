"""Shared helpers of the benchmarks: the `env` block every results file starts with, the results writer,
CUDA-graph timing and copy bandwidth."""
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch

from tfm_runtime.io import atomic_write_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("torch", "triton", "transformers", "deepspeed", "flash-linear-attention")
L2_BYTES = 60 * 2**20  # H200; inputs are rotated so one timed pass touches several times this


def git_state() -> tuple[str | None, bool | None]:
    """(revision, dirty) of the working tree. `TFM_GIT_REV` overrides both where a device copy's .git is stale
    or absent: its revision, dirty when it ends in "-dirty", else not known (None)."""
    rev = os.environ.get("TFM_GIT_REV")
    if rev:
        return rev.removesuffix("-dirty"), True if rev.endswith("-dirty") else None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return rev, bool(status.strip())


def gpu_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def command() -> str:
    """This process's command line, as `python -m <module> ...` when it runs a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def env() -> dict:
    """The block every results file starts with: git revision and dirty flag, GPU and driver, package
    versions, command line and date (UTC)."""
    rev, dirty = git_state()
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions.update(cuda=torch.version.cuda, python=platform.python_version())
    cuda = torch.cuda.is_available()
    return {"git_revision": rev, "dirty": dirty, "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "driver": gpu_driver() if cuda else None, "versions": versions, "command": command(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_results(path: str, results: dict) -> None:
    """Write a results file atomically, keys in the order given: `env` first, then the rows."""
    if next(iter(results), None) != "env":
        raise ValueError(f"a results file starts with its env block, got keys {list(results)[:3]}")
    atomic_write_text(path, json.dumps(results, indent=1) + "\n")


def n_copies(bytes_per_call: int, cap: int = 32) -> int:
    """How many input sets to rotate through so that repeated calls do not run out of L2."""
    return max(1, min(cap, -(-4 * L2_BYTES // max(1, bytes_per_call))))


def fwd_bwd_ms(fn, leaf: torch.Tensor, iters: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of fn().sum().backward() on CUDA (events around each iteration, which syncs), the
    leaf's gradient reset before each; the first `warmup` iterations (compilation, allocator) are not timed."""
    out = []
    for i in range(warmup + iters):
        leaf.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn().sum().backward()
        b.record()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b))
    return statistics.median(out)


def time_calls(fns, reps: int = 7, min_calls: int = 20) -> dict:
    """Median microseconds per call of `fns` (one callable per rotated input set).

    On CUDA one graph calls the fns in turn (>= min_calls calls, launch gaps removed) and is
    replayed `reps` times; per-replay mean per call, median over replays. Falls back to eager
    event timing if capture fails. On CPU (smoke runs) a single wall-clock pass.
    """
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for f in fns:
            f()
        return dict(us=(time.perf_counter() - t) * 1e6 / len(fns), method="cpu-wall")
    n = len(fns)
    calls = n * max(1, -(-min_calls // n))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:  # warm-up: compile, autotune caches, allocator pools
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % n]()
        run, method = graph.replay, "cuda-graph"
    except Exception as e:  # noqa: BLE001 - record and fall back to eager timing
        torch.cuda.synchronize()
        method = f"eager (graph capture failed: {type(e).__name__})"

        def run():
            for i in range(calls):
                fns[i % n]()
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) * 1e3 / calls)
    return dict(us=statistics.median(samples), us_min=min(samples), us_max=max(samples), method=method,
                calls_per_replay=calls, input_sets=n)


def copy_bandwidth(gib: float = 2.0) -> float | None:
    """Measured device-to-device copy bandwidth in TB/s, counting bytes read plus written."""
    if not torch.cuda.is_available():
        return None
    x = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    # An elementwise kernel, not copy_(): in a graph copy_ is a memcpy node, timed at only 2.7 TB/s
    # on the H200 here (probably a copy engine), below what kernels read.
    r = time_calls([lambda: torch.mul(x, 1.0, out=y)], reps=5, min_calls=5)
    del x, y
    return 2 * gib * 2**30 / (r["us"] * 1e-6) / 1e12


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm()).item()
