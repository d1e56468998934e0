"""BatchedGenerator (tfm_runtime.rollout) against HF generate on tiny float64 targets: greedy token-for-token, EOS,
refill and compaction, sampling determinism, bad input, and the Rollout stage's dispatch; then the CPU path through
tfm_runtime.rollout_check: float32 token for token, bf16 divergences only at rounding ties, a broken engine caught
(the CUDA-graphed path: test_rollout_gpu.py)."""
import pytest
import torch

from pipelines.collect.rollout import hf_regenerate, regenerate
from tfm_runtime.rollout import BatchedGenerator, request_key, sample_tokens, unsupported_reason
from tfm_runtime.worlds import tiny_target

LENGTHS = [5, 1, 12, 7, 3, 9, 2]


@pytest.fixture(scope="module")
def targets():
    return {f: tiny_target(f, dtype=torch.float64, layers=3, tap_layer_ids=()).model for f in ("llama", "qwen3")}


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens, eos_token_id=None):
    """HF generate on one prompt (no padding); None: EOS off."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(eos_token_id) + 1] if eos_token_id in out else out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_hf_generate_with_refill(targets, family):
    model = targets[family]
    prompts = random_prompts(LENGTHS)
    ref = [hf_greedy(model, p, 8) for p in prompts]
    gen = BatchedGenerator(model, max_slots=3, max_len=32, min_bucket=1)   # 7 prompts, 3 slots: refills
    assert gen.generate(prompts, max_new_tokens=8) == ref
    assert gen.stats["prefill_batches"] >= 3 and gen.stats["new_tokens"] == 8 * len(prompts)
    assert gen.generate(prompts[:2], max_new_tokens=3) == [r[:3] for r in ref[:2]]   # the engine is reusable


def test_eos_inclusive_and_compaction(targets):
    model = targets["llama"]
    a = random_prompts([6])[0]
    eos = hf_greedy(model, a, 8)[1]                  # A stops after 2 tokens
    b = next(p for p in random_prompts([4] * 20, seed=1) if eos not in hf_greedy(model, p, 8))
    prompts = [a] * 6 + [b] * 2 + random_prompts([3, 10], seed=2)
    ref = [hf_greedy(model, p, 8, eos) for p in prompts]
    assert ref[0][-1] == eos and len(ref[0]) == 2 and len(ref[6]) == 8
    gen = BatchedGenerator(model, max_slots=8, max_len=32, min_bucket=1, check_every=1)
    assert gen.generate(prompts, max_new_tokens=8, eos_token_id=eos) == ref
    assert gen.stats["compactions"] >= 1             # the B rows moved down once the A rows finished
    assert gen.generate([a, b], max_new_tokens=1, eos_token_id=eos) == [ref[0][:1], ref[6][:1]]


def test_sampling_is_seeded_per_request(targets):
    model = targets["qwen3"]
    prompts = random_prompts(LENGTHS, seed=3)
    seeds = [10 + i for i in range(len(prompts))]
    kw = dict(max_new_tokens=6, temperature=1.0)
    gen = BatchedGenerator(model, max_slots=8, max_len=32, min_bucket=1)
    out = gen.generate(prompts, seed=seeds, **kw)
    assert BatchedGenerator(model, max_slots=2, max_len=32).generate(prompts, seed=seeds, **kw) == out
    assert gen.generate([prompts[4]], seed=[seeds[4]], **kw) == [out[4]]    # independent of the other requests
    assert gen.generate(prompts, seed=seeds[::-1], **kw) != out


def test_steps_with_all_slots_done_change_nothing(targets, monkeypatch):
    """What CUDA-graph warm-up and capture rely on: a decode step run while every slot is marked done leaves the
    results unchanged (checked on the CPU by running one before every real step)."""
    model = targets["llama"]
    prompts = random_prompts(LENGTHS, seed=5)
    eos = hf_greedy(model, prompts[2], 6)[1]
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=6, temperature=temperature, eos_token_id=eos, seed=1)
        gen = BatchedGenerator(model, max_slots=3, max_len=32, min_bucket=1)
        ref = gen.generate(prompts, **kw)
        real = gen._step

        def step(b, lb, sample):
            saved = gen.done.clone()
            gen.done.fill_(True)
            real(b, lb, sample)
            gen.done.copy_(saved)
            real(b, lb, sample)
        monkeypatch.setattr(gen, "_step", step)
        assert gen.generate(prompts, **kw) == ref


def test_sample_tokens_follow_the_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0], dtype=torch.float64)
    n = 40_000
    keys = torch.tensor([request_key(5, i) for i in range(n)])
    for temperature in (1.0, 0.5):
        got = sample_tokens(logits.expand(n, -1), temperature, keys, torch.full((n,), 3))
        freq = torch.bincount(got, minlength=6).double() / n
        assert (freq - torch.softmax(logits / temperature, -1)).abs().max() < 0.01
    one_key = sample_tokens(logits.expand(n, -1), 1.0, keys[:1].expand(n), torch.arange(n))   # one request's steps
    assert (torch.bincount(one_key, minlength=6).double() / n - torch.softmax(logits, -1)).abs().max() < 0.01


def test_bad_input_fails_clearly(targets):
    gen = BatchedGenerator(targets["llama"], max_slots=2, max_len=16)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([[5, 6], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 has 14 tokens.*18 cache positions, more than max_len=16"):
        gen.generate([list(range(3, 17))], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[5, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        gen.generate([[5, 6]], max_new_tokens=4, seed=[1, 2])
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[5, 6]], max_new_tokens=0)
    assert gen.generate([], max_new_tokens=4) == []
    hybrid = tiny_target("qwen3_5", dtype=torch.float64, layers=4).model
    assert "not one of the supported dense families" in unsupported_reason(hybrid)
    with pytest.raises(TypeError, match="cannot run"):
        BatchedGenerator(hybrid)


def test_regenerate_dispatch(targets):
    """Dense targets take the fast path and agree with the HF path (greedy); hybrids fall back to HF generate."""
    model = targets["llama"]
    prompts = random_prompts(LENGTHS, seed=4)
    eos = hf_greedy(model, prompts[0], 6)[2]
    kw = dict(max_new_tokens=6, temperature=0.0, eos_token_id=eos, pad_token_id=0, batch_size=3, seed=0)
    assert regenerate(model, prompts, **kw) == hf_regenerate(model, prompts, **kw)
    hybrid = tiny_target("qwen3_5", dtype=torch.float64, layers=4).model
    assert regenerate(hybrid, prompts[:3], **kw) == hf_regenerate(hybrid, prompts[:3], **kw)


# ---- correctness against Hugging Face generate (tfm_runtime.rollout_check) -------------------------------------------
def test_prompt_logits_are_the_logits_of_the_first_new_token(targets):
    model = targets["qwen3"]
    prompts = random_prompts(LENGTHS, seed=6)
    gen = BatchedGenerator(model, max_slots=3, max_len=32, min_bucket=1)
    logits = gen.prompt_logits(prompts)
    ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, ref, rtol=1e-10, atol=1e-10)
    assert [[t] for t in logits.argmax(-1).tolist()] == gen.generate(prompts, max_new_tokens=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_equals_hf_generate_on_the_cpu(family):
    """The CPU path (eager decode steps) in float32: token for token HF generate's, first logits at rounding level."""
    from tfm_runtime.rollout_check import compare_with_hf
    model = tiny_target(family, dtype=torch.float32, layers=3, tap_layer_ids=()).model
    reference = tiny_target(family, dtype=torch.float64, layers=3, tap_layer_ids=()).model
    report = compare_with_hf(model, random_prompts(LENGTHS, seed=7), 16, reference=reference,
                             engine=dict(max_slots=3, min_bucket=1))        # 7 prompts in 3 slots: refills
    assert report["identical"] == 1.0, report["divergences"]
    assert report["first_logits"]["within_rounding"], report["first_logits"]


def test_bfloat16_divergences_are_rounding_ties():
    """In bf16 greedy outputs may part at near-ties: every first divergence must be one, i.e. the two tokens' logits
    (float32 forward of the same weights) differ by no more than a few times bf16's own error at that position."""
    from tfm_runtime.rollout_check import compare_with_hf
    model = tiny_target("qwen3", dtype=torch.bfloat16, layers=3, tap_layer_ids=()).model
    reference = tiny_target("qwen3", dtype=torch.bfloat16, layers=3, tap_layer_ids=()).model.float()
    report = compare_with_hf(model, random_prompts([6] * 12, seed=8), 24, reference=reference,
                             engine=dict(max_slots=4, min_bucket=1))
    d = report["first_divergence"]
    print("bf16 first divergence:", d, "identical:", report["identical"])
    assert d["count"] >= 1, "no divergence at all: the test would not exercise the tie analysis"
    assert report["explained_by_rounding"] == 1.0, report["divergences"]
    assert report["first_logits"]["within_rounding"], report["first_logits"]


def test_the_comparison_catches_a_wrong_engine(monkeypatch):
    """Teeth: decode steps that hide each token's own key give divergences that are not ties; a prefill without
    the rotary embedding gives first logits off by more than rounding."""
    from tfm_runtime import rollout
    from tfm_runtime.rollout_check import compare_with_hf
    model = tiny_target("llama", dtype=torch.float32, layers=3, tap_layer_ids=()).model
    reference = tiny_target("llama", dtype=torch.float64, layers=3, tap_layer_ids=()).model
    prompts = random_prompts([5] * 6, seed=9)
    real_attention = rollout._decode_attention

    def off_by_one(q, kc, vc, masked, scale):
        return real_attention(q, kc, vc, torch.cat([masked[..., 1:], torch.ones_like(masked[..., :1])], -1), scale)
    monkeypatch.setattr(rollout, "_decode_attention", off_by_one)
    report = compare_with_hf(model, prompts, 12, reference=reference)
    assert report["identical"] < 1.0 and report["explained_by_rounding"] < 1.0, report
    assert report["first_logits"]["within_rounding"]                    # the prefill is still right
    monkeypatch.setattr(rollout, "_decode_attention", real_attention)
    monkeypatch.setattr(rollout, "_rotate_half", lambda x: torch.zeros_like(x))
    report = compare_with_hf(model, prompts, 2, reference=reference)
    assert not report["first_logits"]["within_rounding"], report["first_logits"]
