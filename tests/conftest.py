import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (make test: one worker per core) each worker keeps to one thread; tiny matmuls gain nothing
# from more and threads that outnumber the cores spin.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Without CUDA the Triton kernels run under the interpreter (fp32/fp16, tiny shapes). It must be set before any
# kernel module is imported: @triton.jit reads it at decoration.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs only under TRITON_INTERPRET=1 (the CPU kernel tests)")


# Modules whose module-scoped fixture is a service or a run that its tests share (a Ray cluster, a Hub server with
# pushed artifacts): under pytest-xdist each runs on one worker, so the fixture is built once (see
# pytest_xdist_make_scheduler). Every other test is scheduled on its own.
ONE_WORKER_MODULES = ("test_collect_job", "test_export")


def pytest_xdist_make_scheduler(config, log):
    """Load scheduling with a scope per test, except one scope per module of ONE_WORKER_MODULES."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if os.path.basename(module)[:-3] in ONE_WORKER_MODULES else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device (not the interpreter); `interpreter` tests run only under the interpreter.
    Slow tests go first, so the long ones start early on the xdist workers and the short ones fill in the end."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cpu = pytest.mark.skip(reason="CPU kernel tests run under TRITON_INTERPRET=1")
    for item in items:
        if item.get_closest_marker("gpu") and not ON_GPU:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("interpreter") and not INTERPRET:
            item.add_marker(skip_cpu)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)           # stable: slow ones first


@pytest.fixture(scope="session")
def build_once(tmp_path_factory):
    """build_once(name, build) -> a folder made by `build(folder)` once per test run, shared by every xdist worker
    (it lies in the parent of the workers' base temp folders): the first worker to ask builds it under a file lock,
    the others wait and reuse it. A build that raises leaves no `.built` mark, so the next one to ask rebuilds."""
    import shutil

    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, build):
        target = shared / name
        with FileLock(str(shared / f"{name}.lock")):
            if not (target / ".built").is_file():
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                build(target)
                (target / ".built").write_text("")
        return target
    return get


@pytest.fixture()
def run_here(caplog):
    """run_here(module, *args) -> (exit code, stdout, stderr and log) of `python -m module *args` run as `__main__`
    in this interpreter (runpy), where torch, DeepSpeed and transformers are already imported: a process start
    costs more than the short runs the tests make. For tests that need no process of their own (no signal, no
    environment read at import). The world-of-one process group that pipelines.train sets up stays for the worker's
    later runs, which adopt it as the runs of one tests/train_runs.py interpreter do (DeepSpeed keeps a handle on
    it); the variables that describe it are set only while a run runs, so that no subprocess started later by a
    test of this worker inherits them. Its stdout and stderr go to buffers of its own that stay open: a logging
    handler made during the run (DeepSpeed's, at import) keeps writing to them without error in later tests."""
    import contextlib
    import io
    import logging
    import runpy
    import sys

    import torch.distributed as dist
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def run(module: str, *args: str) -> tuple[int, str, str]:
        saved_env = {k: os.environ.pop(k) for k in keys if k in os.environ}
        if dist.is_initialized():                     # an earlier run's world of one, as init_distributed set it up
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        saved_argv = sys.argv
        out, err = io.StringIO(), io.StringIO()
        caplog.clear()
        sys.argv = [module, *args]
        try:
            with caplog.at_level(logging.INFO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = saved_argv
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update(saved_env)
        return code, out.getvalue(), err.getvalue() + caplog.text
    return run


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where the kernel tests put their tensors: "cpu" under the Triton interpreter, else "cuda"."""
    return "cpu" if INTERPRET else "cuda"


@pytest.fixture(scope="session")
def worlds64():
    """float64 tiny worlds for every family, built once per session."""
    from tfm_runtime.worlds import FAMILIES, tiny_world
    return {f: tiny_world(f, dtype=torch.float64) for f in FAMILIES}


@pytest.fixture()
def poison_empty(monkeypatch):
    """Fresh float buffers from torch.empty / torch.empty_like are NaN, so any output element a kernel forgets to
    write fails."""
    import math
    real, real_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))


@pytest.fixture()
def strided_copies(monkeypatch):
    """The shapes of the tensors `.contiguous()` copies (non-contiguous ones) from the moment the fixture is
    requested: a kernel wrapper that reads strided views in place adds none."""
    real, copied = torch.Tensor.contiguous, []

    def spy(t, *a, **k):
        if not t.is_contiguous():
            copied.append(tuple(t.shape))
        return real(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    return copied
