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
