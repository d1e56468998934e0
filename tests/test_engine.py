"""The reference decoder: greedy speculative output equals Hugging Face greedy generation, for every
proposal (chain, DDTree, Weaver), budgets 1/16/64, dense and hybrid tiny targets."""
import pytest
import torch

from tfm_runtime.contract import ContractError
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.worlds import FAMILIES, tiny_world

PROMPTS = [[5, 17, 33, 2, 91, 14], [200, 3]]
NEW = 24


def hf_greedy(world, prompt, n):
    ids = torch.tensor([prompt])
    out = world.target.model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(worlds64):
    return {(f, i): hf_greedy(worlds64[f], p, NEW) for f in FAMILIES for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposal", ["chain", "ddtree", "weaver"])
@pytest.mark.parametrize("budget", [1, 16, 64])
def test_greedy_equals_hf_generate(worlds64, reference, family, proposal, budget):
    w = worlds64[family]
    dec = SpeculativeDecoder(w.target, w.drafter, w.weaver if proposal == "weaver" else None,
                             tree_budget=budget, proposal=proposal)
    for i, p in enumerate(PROMPTS):
        out = dec.generate(p, max_new_tokens=NEW, temperature=0.0)
        assert out.tokens == reference[(family, i)], f"prompt {i}"
        s = out.stats
        assert s.new_tokens == NEW and s.verify_steps == len(s.accept_lengths) >= 1
        assert max(s.tree_sizes) <= budget + 1
        assert all(1 <= a <= min(budget, w.drafter.lookahead) + 1 for a in s.accept_lengths)


def test_stats_and_eos(worlds64):
    w = worlds64["llama"]
    dec = SpeculativeDecoder(w.target, w.drafter, w.weaver, tree_budget=16)
    out = dec.generate(PROMPTS[0], max_new_tokens=NEW)
    eos = out.tokens[5]
    out2 = dec.generate(PROMPTS[0], max_new_tokens=NEW, eos_token_id=eos)
    assert out2.tokens == out.tokens[: out.tokens.index(eos) + 1]
    summary = out.stats.summary()
    assert set(summary["seconds"]) >= {"prefill", "draft", "tree", "verify", "commit"}
    assert sum(summary["histogram"].values()) == summary["verify_steps"]


def test_incompatible_models_raise(worlds64):
    w = worlds64["llama"]
    other = tiny_world("qwen3", vocab_size=300)
    with pytest.raises(ContractError, match="vocab_size"):
        SpeculativeDecoder(w.target, other.drafter)
    with pytest.raises(ValueError, match="Weaver adapter"):
        SpeculativeDecoder(w.target, w.drafter, None, proposal="weaver")
    dec = SpeculativeDecoder(w.target, w.drafter)
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=4)


def test_greedy_verification_is_refused_above_temperature_zero(worlds64):
    """Greedy verification is lossless only at T = 0: at T > 0 it would emit argmax tokens, not samples."""
    w = worlds64["llama"]
    dec = SpeculativeDecoder(w.target, w.drafter, None, tree_budget=8, proposal="ddtree", verification="greedy")
    assert len(dec.generate(PROMPTS[0], max_new_tokens=4, temperature=0.0).tokens) == 4
    with pytest.raises(ValueError, match=r"verification='greedy'.*temperature 0.*got temperature 0.7"):
        dec.generate(PROMPTS[0], max_new_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="chain_sampling.*proposal='chain'"):
        SpeculativeDecoder(w.target, w.drafter, None, proposal="ddtree", verification="chain_sampling")


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_tree_verification_under_supported_attention(implementation):
    """The 4-D additive tree mask is honoured by eager and SDPA attention: greedy output equals HF generate."""
    from tfm_runtime.worlds import tiny_target
    w = tiny_world("llama", dtype=torch.float64)
    target = tiny_target("llama", dtype=torch.float64, attn_implementation=implementation)
    assert target.model.config._attn_implementation == implementation
    dec = SpeculativeDecoder(target, w.drafter, None, tree_budget=16, proposal="ddtree")
    assert dec.generate(PROMPTS[0], max_new_tokens=12).tokens == hf_greedy(w, PROMPTS[0], 12)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "sdpa_paged"])
def test_tree_verification_refuses_other_attention_implementations(implementation):
    w = tiny_world("llama")
    w.target.model.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=f"attention implementation '{implementation}'.*'eager' or 'sdpa'"):
        SpeculativeDecoder(w.target, w.drafter)


def test_tree_verification_refuses_sliding_window_layers():
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    from tfm_runtime.models import TargetModel
    w = tiny_world("llama")
    sizes = dict(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2)
    qwen = Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=3, head_dim=16, **sizes)
    assert "sliding_attention" in qwen.layer_types
    mistral = MistralConfig(sliding_window=16, **sizes)
    for cfg, match in [(qwen, r"layers \[3, 4, 5\] are 'sliding_attention'"),
                       (mistral, "every layer attends through a sliding window of 16 tokens")]:
        torch.manual_seed(0)
        target = TargetModel(AutoModelForCausalLM.from_config(cfg).eval(), w.drafter.cfg.target_layer_ids)
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(target, w.drafter)


def test_the_cache_is_passed_under_its_current_name(worlds64):
    """transformers deprecates `past_key_values` (a warning on every decode, the name removed in 5.40): the runtime
    passes `cache`, so decoding logs no deprecation warning, and no runtime module uses the old name."""
    import logging
    import pathlib

    from transformers.utils import logging as hf_logging

    import tfm_runtime

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Collect()
    hf_logging.get_logger().addHandler(handler)
    hf_logging.warning_once.cache_clear()                 # the warning is logged once per process
    try:
        for family in ("llama", "qwen3_5"):
            w = worlds64[family]
            SpeculativeDecoder(w.target, w.drafter, w.weaver, tree_budget=8).generate(PROMPTS[0], max_new_tokens=6)
    finally:
        hf_logging.get_logger().removeHandler(handler)
    assert not [m for m in handler.messages if "deprecated" in m], handler.messages
    root = pathlib.Path(tfm_runtime.__file__).parent
    old = [str(f.relative_to(root)) for f in root.rglob("*.py") if "past_key_values=" in f.read_text()]
    assert not old, f"modules passing past_key_values=: {old}"
