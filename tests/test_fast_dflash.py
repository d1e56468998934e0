"""StaticDFlash (static context cache, shape-static extend / draft) against the reference DFlashDrafter: the same
draft logits and hidden states over several rounds of context growth, in float64 on the CPU (full and
sliding-window layers) and with CUDA graphs on CUDA; bad sizes are refused."""
import dataclasses

import pytest
import torch

from tfm_runtime.fast.dflash import StaticDFlash
from tfm_runtime.models.dflash import DFlashDrafter
from tfm_runtime.worlds import tiny_world


def drafter_and_weights(sliding: bool, device="cpu", dtype=torch.float64):
    w = tiny_world("qwen3")
    drafter = w.drafter
    if sliding:                                   # every other layer a sliding window shorter than the context
        cfg = dataclasses.replace(drafter.cfg, layer_types=["sliding_attention", "full_attention"]
                                  * (drafter.cfg.num_hidden_layers // 2) + ["full_attention"]
                                  * (drafter.cfg.num_hidden_layers % 2), sliding_window=5)
        other = DFlashDrafter(cfg)
        other.load_state_dict(drafter.state_dict())
        drafter = other
    drafter = drafter.to(device=device, dtype=dtype).eval()
    embed = w.target.embed_weight.detach().to(device=device, dtype=dtype)
    head = w.target.lm_head_weight.detach().to(device=device, dtype=dtype)
    return drafter, embed, head


def rounds(drafter, embed, head, static: StaticDFlash, counts, seed=0):
    """Prefill 7 positions, then for each n in counts: draft with both, extend both by n positions."""
    g = torch.Generator().manual_seed(seed)
    F = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    dev, dt = embed.device, embed.dtype
    taps = torch.randn(7, F, generator=g, dtype=torch.float64).to(device=dev, dtype=dt)
    cache = drafter.new_cache()
    drafter.extend_context(cache, taps[None])
    static.prefill(taps)
    for n in counts:
        bonus = torch.randint(0, embed.shape[0] - 1, (1,), generator=g).to(dev)
        ref_logits, ref_hidden = drafter.draft(cache, bonus, embed, head)
        logits, hidden = static.draft(bonus)
        yield (logits, ref_logits[0]), (hidden, ref_hidden[0])
        taps = torch.randn(n, F, generator=g, dtype=torch.float64).to(device=dev, dtype=dt)
        drafter.extend_context(cache, taps[None])
        static.extend(taps)
        assert int(static.length) == cache.length


@pytest.mark.parametrize("sliding", [False, True])
def test_static_drafts_equal_the_reference_drafter(sliding):
    drafter, embed, head = drafter_and_weights(sliding)
    S = drafter.cfg.block_size
    static = StaticDFlash(drafter, embed, head, max_len=64)
    for pair in rounds(drafter, embed, head, static, [1, S, 3, 2, S - 1, 1]):
        for got, want in pair:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.interpreter
@pytest.mark.parametrize("sliding", [False, True])
def test_the_rope_kernel_stands_in_for_the_drafters_rotary_and_cache_writes(sliding, monkeypatch):
    """In CUDA inference each layer's q / k rotation and its context-cache writes are one launch
    (`tfm_kernels.rope.rope_cache`), and its output projection and MLP three (`tfm_kernels.small_linear`); forced
    here (the Triton interpreter, float32) the drafts equal the reference drafter's."""
    import tfm_runtime.fast.dense as dense
    import tfm_runtime.fast.dflash as dflash
    drafter, embed, head = drafter_and_weights(sliding, dtype=torch.float32)
    monkeypatch.setattr(dense, "inference_kernel_ok", lambda *a: True)
    monkeypatch.setattr(dflash, "small_linear_ok", lambda *a: True)
    static = StaticDFlash(drafter, embed, head, max_len=64)
    for pair in rounds(drafter, embed, head, static, [1, drafter.cfg.block_size, 3, 2]):
        for got, want in pair:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_new_request_starts_from_an_empty_context():
    """prefill forgets the previous request: drafts equal a fresh StaticDFlash's."""
    drafter, embed, head = drafter_and_weights(False)
    used = StaticDFlash(drafter, embed, head, max_len=64)
    list(rounds(drafter, embed, head, used, [5, drafter.cfg.block_size, 4], seed=1))
    fresh = StaticDFlash(drafter, embed, head, max_len=64)
    for (a, _), (b, _) in zip(rounds(drafter, embed, head, used, [2, 3]), rounds(drafter, embed, head, fresh, [2, 3])):
        torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)


def test_fused_projections_share_the_drafter_s_weights(tmp_path):
    """StaticDFlash runs each layer's q/k/v and gate/up as one GEMM on one tensor per group that the drafter's own
    modules now view (no copy; a second StaticDFlash re-homes nothing), and the drafter still saves and loads the
    same weights."""
    drafter, embed, head = drafter_and_weights(False)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    static = StaticDFlash(drafter, embed, head, max_len=32)
    for layer, (qkv, _, gate_up, _) in zip(drafter.layers, static.fused):
        a, m = layer.self_attn, layer.mlp
        assert a.q_proj.weight.data_ptr() == qkv.data_ptr()
        assert a.v_proj.weight.data_ptr() == qkv.data_ptr() + (qkv.numel() - a.v_proj.weight.numel()) * 8
        assert m.up_proj.weight.data_ptr() == gate_up.data_ptr() + m.gate_proj.weight.numel() * 8
    assert StaticDFlash(drafter, embed, head, max_len=32).fused[1][0].data_ptr() == static.fused[1][0].data_ptr()
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in before.items())
    drafter.save_pretrained(str(tmp_path))
    again = DFlashDrafter.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in before.items())


def test_bad_sizes_are_refused():
    drafter, embed, head = drafter_and_weights(False)
    S = drafter.cfg.block_size
    static = StaticDFlash(drafter, embed, head, max_len=16)
    F = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    with pytest.raises(ValueError, match="does not fit"):
        static.prefill(torch.zeros(17, F, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not fit"):
        static.prefill(torch.zeros(0, F, dtype=torch.float64))
    static.prefill(torch.zeros(4, F, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"1..{S} positions"):
        static.extend(torch.zeros(S + 1, F, dtype=torch.float64))


@pytest.mark.gpu
def test_cuda_graphs_equal_the_reference_drafter_on_cuda():
    drafter, embed, head = drafter_and_weights(True, device="cuda", dtype=torch.float32)
    S = drafter.cfg.block_size
    static = StaticDFlash(drafter, embed, head, max_len=96, cuda_graphs=True)
    assert sorted(static.graphs) == ["draft", "extend"]
    for pair in rounds(drafter, embed, head, static, [1, S, 3, 2, S - 1, 1, 7]):
        for got, want in pair:
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
