"""tfm_runtime.load_adapter on a local folder: a damaged safetensors file is named."""
from __future__ import annotations

import os

import pytest
import torch


# ---- a tiny world's adapter (no training needed) ---------------------------------------------------------------------
@pytest.fixture()
def adapter_dir(tmp_path):
    from tfm_runtime.worlds import tiny_world
    w = tiny_world("llama")
    path = str(tmp_path / "adapter")
    w.weaver.save_pretrained(path)
    w.contract.save(os.path.join(path, "contract.json"))
    return path, w


@pytest.mark.parametrize("damage, message", [("truncate", "truncated safetensors file"),
                                             ("garbage", "not a safetensors file"),
                                             ("append", "bytes after the last tensor")])
def test_a_damaged_safetensors_file_is_named(adapter_dir, damage, message):
    from tfm_runtime import load_adapter
    path, _ = adapter_dir
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    damaged = {"truncate": data[:-100], "garbage": (12).to_bytes(8, "little") + b"not json!!!!" + data[20:],
               "append": data + b"\0" * 7}[damage]
    with open(f, "wb") as fh:
        fh.write(damaged)
    with pytest.raises(ValueError, match=message) as e:
        load_adapter(path)
    assert f in str(e.value)
