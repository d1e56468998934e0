"""tfm_runtime.loading: targets and drafters load from safetensors only; a damaged or truncated file is named with
what is wrong; a loaded model reports the spec it was loaded from (what the adapter's contract is checked against)."""
from __future__ import annotations

import os

import pytest
import torch

from tfm_runtime.loading import ModelSpec, load_drafter, load_target
from tfm_runtime.worlds import tiny_drafter, tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("target"))
    tiny_target("llama").model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def copy_folder(src: str, dst) -> str:
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return str(dst)


def damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    damaged = {"truncate": data[:-100], "garbage": (12).to_bytes(8, "little") + b"not json!!!!" + data[20:],
               "append": data + b"\0" * 7}[how]
    with open(path, "wb") as f:
        f.write(damaged)


def test_a_target_loads_from_safetensors_and_reports_its_spec(target_dir):
    t = load_target(ModelSpec(target_dir, revision="r1"), [1, 3])
    ref = tiny_target("llama")
    assert torch.equal(t.lm_head_weight, ref.lm_head_weight)
    assert (t.model_id, t.revision, t.tap_layer_ids) == (target_dir, "r1", (1, 3))
    assert t.tokenizer_hash == ref.tokenizer_hash is not None
    assert load_target(ModelSpec(target_dir, id="org/model"), []).model_id == "org/model"
    assert load_target("tiny:qwen3:4", []).model_id == "tiny:qwen3:4"


def test_a_target_with_pickle_checkpoints_only_is_refused(target_dir, tmp_path):
    """use_safetensors=True: a folder holding pytorch_model.bin alone is never unpickled."""
    d = copy_folder(target_dir, tmp_path / "pickled")
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save(tiny_target("llama").model.state_dict(), os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file.*'pytorch_model.bin'.*never loaded"):
        load_target(d)


@pytest.mark.parametrize("how, message", [("truncate", "truncated safetensors file"),
                                          ("garbage", "not a safetensors file"),
                                          ("append", "bytes after the last tensor")])
def test_a_damaged_target_or_drafter_file_is_named(target_dir, tmp_path, how, message):
    d = copy_folder(target_dir, tmp_path / "target")
    f = os.path.join(d, "model.safetensors")
    damage(f, how)
    with pytest.raises(ValueError, match=message) as e:
        load_target(d)
    assert f in str(e.value)
    dd = str(tmp_path / "drafter")
    tiny_drafter("llama").save_pretrained(dd)
    f = os.path.join(dd, "model.safetensors")
    damage(f, how)
    with pytest.raises(ValueError, match=message) as e:
        load_drafter(dd)
    assert f in str(e.value)


def test_a_drafter_reports_its_spec(tmp_path):
    d = str(tmp_path / "drafter")
    tiny_drafter("llama").save_pretrained(d)
    assert (load_drafter(d).model_id, load_drafter(ModelSpec(d, revision="r", id="org/d")).revision) == (d, "r")
    assert load_drafter(ModelSpec(d, id="org/d")).model_id == "org/d"
    assert load_drafter("tiny:llama:2").model_id == tiny_drafter("llama", seed=2).model_id == "tiny:llama:2"
