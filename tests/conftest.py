import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

# Without CUDA the Triton kernels run under the interpreter (fp32/fp16, tiny shapes). It must be set before any
# kernel module is imported: @triton.jit reads it at decoration.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs only under TRITON_INTERPRET=1 (the CPU kernel tests)")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device (not the interpreter); `interpreter` tests run only under the interpreter."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cpu = pytest.mark.skip(reason="CPU kernel tests run under TRITON_INTERPRET=1")
    for item in items:
        if item.get_closest_marker("gpu") and not ON_GPU:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("interpreter") and not INTERPRET:
            item.add_marker(skip_cpu)


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
