"""tfm_runtime.load_adapter on a local folder: the contract checked against the target and drafter it is given,
and refusals that name what is wrong (no contract.json, pickle checkpoints only, a damaged safetensors file).
Loading from the Hub is tested end to end in test_export.py."""
from __future__ import annotations

import os
import shutil

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


def test_load_adapter_checks_the_contract_against_the_target_and_drafter(adapter_dir):
    from tfm_runtime import ContractError, load_adapter
    from tfm_runtime.loading import load_drafter_config, target_config
    from tfm_runtime.worlds import tiny_drafter_config, tiny_target
    path, w = adapter_dir
    a = load_adapter(path, target=w.target, drafter=w.drafter)
    assert a.contract == w.contract and a.commit_sha is None
    load_adapter(path, target=target_config("tiny:llama:0"), drafter=load_drafter_config("tiny:llama:0"))
    load_adapter(path, target=w.target.model)                                 # a plain Hugging Face causal LM
    cases = [({"target": tiny_target("llama", hidden=32)}, "target_hidden_size", 64, 32),
             ({"target": tiny_target("llama", vocab_size=300)}, "vocab_size", 262, 300),
             ({"target": tiny_target("llama", tap_layer_ids=[2])}, "tap_layer_ids", (1, 3), (2,)),
             ({"drafter": tiny_drafter_config(block_size=4)}, "block_size", 8, 4)]
    for kwargs, field, expected, actual in cases:
        with pytest.raises(ContractError) as e:
            load_adapter(path, **kwargs)
        assert (e.value.field, e.value.expected, e.value.actual) == (field, expected, actual)
        assert f"field '{field}'" in str(e.value) and path in str(e.value)


def test_load_adapter_refuses_a_folder_without_contract_or_with_pickles_only(adapter_dir, tmp_path):
    from tfm_runtime import load_adapter
    path, _ = adapter_dir
    os.remove(os.path.join(path, "contract.json"))
    with pytest.raises(FileNotFoundError, match="no contract.json"):
        load_adapter(path)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(path, "config.json"), pickled / "config.json")
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file.*'pytorch_model.bin'.*never loaded"):
        load_adapter(str(pickled))


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
