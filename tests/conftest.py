import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def worlds64():
    """float64 tiny worlds for every family, built once per session."""
    from tfm_runtime.worlds import FAMILIES, tiny_world
    return {f: tiny_world(f, dtype=torch.float64) for f in FAMILIES}


@pytest.fixture()
def poison_empty(monkeypatch):
    """Fresh float buffers from torch.empty are NaN, so any output element a kernel forgets to write fails."""
    import math
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
