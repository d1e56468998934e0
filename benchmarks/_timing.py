"""Shared helpers of the kernel benchmarks: environment record, CUDA-graph timing, copy bandwidth."""
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

L2_BYTES = 60 * 2**20  # H200; inputs are rotated so one timed pass touches several times this


def env_info() -> dict:
    """Hardware, versions and git revision (`TFM_GIT_REV` when set: a device copy's .git may be stale)."""
    rev = os.environ.get("TFM_GIT_REV")
    if not rev:
        try:
            rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                   text=True).stdout.strip()
            rev += "-dirty" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            rev = "unknown"
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, git_rev=rev,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(hardware=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda,
                    gpu_mem_gib=round(p.total_memory / 2**30, 1))
    else:
        info.update(hardware="cpu (TRITON_INTERPRET smoke run)")
    return info


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
