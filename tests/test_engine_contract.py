"""SpeculativeDecoder checks the adapter's contract against the models it is handed: a target or drafter of another
world (same sizes, other weights), another revision or another tokenizer is refused by name; a copy of the same
model is accepted when it says which model it is a copy of."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tfm_runtime import ContractError, load_adapter
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.loading import ModelSpec, load_target
from tfm_runtime.models import TargetModel
from tfm_runtime.worlds import tiny_tokenizer, tiny_world

PROMPT = [5, 17, 33, 2, 91]


@pytest.fixture(scope="module")
def worlds():
    return {seed: tiny_world("llama", seed=seed) for seed in (0, 1)}


def save_adapter(world, path, **contract_changes) -> str:
    world.weaver.save_pretrained(path)
    dataclasses.replace(world.contract, **contract_changes).save(os.path.join(path, "contract.json"))
    return path


def refused(target, drafter, adapter) -> ContractError:
    with pytest.raises(ContractError) as e:
        SpeculativeDecoder(target, drafter, adapter, tree_budget=8)
    return e.value


def test_a_target_or_drafter_of_another_world_is_refused(worlds, tmp_path):
    w0, w1 = worlds[0], worlds[1]
    adapter = load_adapter(save_adapter(w0, str(tmp_path / "a")))           # no models given: nothing checked yet
    assert adapter.contract.target_id == "tiny:llama:0"
    e = refused(w1.target, w0.drafter, adapter)                               # same sizes, other weights
    assert (e.field, e.expected, e.actual) == ("target_id", "tiny:llama:0", "tiny:llama:1")
    assert "field 'target_id'" in str(e) and "ModelSpec" in str(e)           # says how to pass a copy
    e = refused(w0.target, w1.drafter, adapter)
    assert (e.field, e.expected, e.actual) == ("drafter_id", "tiny:llama:0", "tiny:llama:1")
    out = SpeculativeDecoder(w0.target, w0.drafter, adapter, tree_budget=8).generate(PROMPT, max_new_tokens=8)
    assert len(out.tokens) == 8
    # the same holds for the world's own Weaver, which carries the world's contract
    assert refused(w1.target, w1.drafter, w0.weaver).field == "target_id"


def test_another_revision_or_tokenizer_is_refused(worlds, tmp_path):
    w0 = worlds[0]
    adapter = load_adapter(save_adapter(w0, str(tmp_path / "tok"), tokenizer_hash="0123456789abcdef"))
    e = refused(w0.target, w0.drafter, adapter)
    assert (e.field, e.expected) == ("tokenizer_hash", "0123456789abcdef")
    assert e.actual == w0.target.tokenizer_hash is not None
    adapter = load_adapter(save_adapter(w0, str(tmp_path / "rev"), target_revision="v2"))
    pinned = load_target(ModelSpec("tiny:llama:0", revision="v1"), w0.target.tap_layer_ids)
    e = refused(pinned, w0.drafter, adapter)
    assert (e.field, e.expected, e.actual) == ("target_revision", "v2", "v1")
    SpeculativeDecoder(w0.target, w0.drafter, adapter, tree_budget=8)        # a target of unknown revision: accepted


def test_a_local_copy_is_accepted_when_it_names_the_model_it_copies(worlds, tmp_path):
    w0 = worlds[0]
    adapter = load_adapter(save_adapter(w0, str(tmp_path / "a")))
    copy = str(tmp_path / "copy")
    w0.target.model.save_pretrained(copy)
    tiny_tokenizer().save_pretrained(copy)
    taps = w0.target.tap_layer_ids
    e = refused(load_target(copy, taps), w0.drafter, adapter)
    assert (e.field, e.expected, e.actual) == ("target_id", "tiny:llama:0", copy)
    target = load_target(ModelSpec(copy, id="tiny:llama:0"), taps)          # the explicit override
    assert target.model_id == "tiny:llama:0" and target.tokenizer_hash == w0.target.tokenizer_hash
    ref = SpeculativeDecoder(w0.target, w0.drafter, adapter, tree_budget=8).generate(PROMPT, max_new_tokens=8)
    out = SpeculativeDecoder(target, w0.drafter, adapter, tree_budget=8).generate(PROMPT, max_new_tokens=8)
    assert out.tokens == ref.tokens
    wrapped = TargetModel(w0.target.model, taps, spec=ModelSpec(copy, id="tiny:llama:0"))    # an HF model in hand
    SpeculativeDecoder(wrapped, w0.drafter, adapter, tree_budget=8)


def test_a_target_that_does_not_say_what_it_is_is_refused(worlds, tmp_path):
    """A Hugging Face model built in code has no name: it cannot be matched to the adapter's contract."""
    w0 = worlds[0]
    adapter = load_adapter(save_adapter(w0, str(tmp_path / "a")))
    from transformers import AutoModelForCausalLM
    anonymous = AutoModelForCausalLM.from_config(w0.target.config).eval()
    anonymous.load_state_dict(w0.target.model.state_dict())
    e = refused(anonymous, w0.drafter, adapter)
    assert (e.field, e.expected, e.actual) == ("target_id", "tiny:llama:0", None)
    named = TargetModel(anonymous, w0.target.tap_layer_ids, spec="tiny:llama:0")
    out = SpeculativeDecoder(named, w0.drafter, adapter, tree_budget=8).generate(PROMPT, max_new_tokens=8)
    assert out.tokens == SpeculativeDecoder(w0.target, w0.drafter, adapter, tree_budget=8).generate(
        PROMPT, max_new_tokens=8).tokens


def test_load_adapter_checks_the_same_identity(worlds, tmp_path):
    w0, w1 = worlds[0], worlds[1]
    path = save_adapter(w0, str(tmp_path / "a"))
    with pytest.raises(ContractError, match="field 'target_id'"):
        load_adapter(path, target=w1.target)
    with pytest.raises(ContractError, match="field 'drafter_id'"):
        load_adapter(path, drafter=w1.drafter)
    load_adapter(path, target=w0.target, drafter=w0.drafter)
    load_adapter(path, target=w1.target.config, drafter=w1.drafter.cfg)      # configs: sizes only


def test_a_local_folder_spelled_two_ways_is_one_model(worlds, tmp_path, monkeypatch):
    w0 = worlds[0]
    copy = tmp_path / "copy"
    w0.target.model.save_pretrained(copy)
    tiny_tokenizer().save_pretrained(copy)
    path = save_adapter(w0, str(tmp_path / "a"), target_id=str(copy), tokenizer_hash=w0.target.tokenizer_hash)
    monkeypatch.chdir(tmp_path)
    target = load_target("./copy", w0.target.tap_layer_ids)                 # relative; the contract's is absolute
    SpeculativeDecoder(target, w0.drafter, load_adapter(path), tree_budget=8)
    assert torch.equal(target.lm_head_weight, w0.target.lm_head_weight)
