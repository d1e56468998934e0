"""DFlash drafter: z-lab folder layout, save/load, context cache."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter

H, NH, NKV, HD, I, V = 64, 4, 2, 16, 96, 200


def zlab_config(**kw):
    cfg = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "block_size": 8, "dflash_config": {"mask_token_id": 199, "target_layer_ids": [1, 3]},
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": NH,
           "num_key_value_heads": NKV, "head_dim": HD, "num_target_layers": 6, "rope_theta": 1e6,
           "vocab_size": V, "rms_norm_eps": 1e-6, "layer_types": ["full_attention", "full_attention"],
           "model_type": "qwen3", "hidden_act": "silu", "torch_dtype": "bfloat16", "max_position_embeddings": 4096}
    cfg.update(kw)
    return cfg


def zlab_weights(n_layers=2, n_taps=2, seed=0):
    """Tensors under z-lab's key names, written independently of our module definition."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    w = {"fc.weight": r(H, n_taps * H), "hidden_norm.weight": 1 + r(H), "norm.weight": 1 + r(H)}
    for i in range(n_layers):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                  p + "self_attn.q_proj.weight": r(NH * HD, H), p + "self_attn.k_proj.weight": r(NKV * HD, H),
                  p + "self_attn.v_proj.weight": r(NKV * HD, H), p + "self_attn.o_proj.weight": r(H, NH * HD),
                  p + "self_attn.q_norm.weight": 1 + r(HD), p + "self_attn.k_norm.weight": 1 + r(HD),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I)})
    return w


def write_zlab_dir(path, cfg=None, weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or zlab_config()))
    save_file(weights or zlab_weights(), str(path / "model.safetensors"))
    return path


def run(model, taps, bonus, embed, head):
    cache = model.new_cache()
    model.extend_context(cache, taps)
    return model.draft(cache, bonus, embed, head)


def test_loads_zlab_layout_and_survives_save_load(tmp_path):
    d = write_zlab_dir(tmp_path / "zlab")
    m = DFlashDrafter.from_pretrained(str(d), dtype=torch.float64)
    assert m.cfg.target_layer_ids == [1, 3] and m.cfg.mask_token_id == 199 and m.lookahead == 7
    torch.testing.assert_close(m.fc.weight, zlab_weights()["fc.weight"].double())
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(V, H, generator=g).double(), torch.randn(V, H, generator=g).double()
    taps = torch.randn(1, 9, 2 * H, generator=g).double()
    logits, hidden = run(m, taps, torch.tensor([5]), embed, head)
    assert logits.shape == (1, 7, V) and hidden.shape == (1, 7, H) and torch.isfinite(logits).all()
    m.save_pretrained(str(tmp_path / "ours"))
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["dflash_config"]["target_layer_ids"] == [1, 3]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(zlab_weights())
    m2 = DFlashDrafter.from_pretrained(str(tmp_path / "ours"), dtype=torch.float64)
    l2, h2 = run(m2, taps, torch.tensor([5]), embed, head)
    torch.testing.assert_close(l2, logits, rtol=0, atol=0)
    torch.testing.assert_close(h2, hidden, rtol=0, atol=0)


def test_incremental_context_cache_equals_one_shot(tmp_path):
    m = DFlashDrafter.from_pretrained(str(write_zlab_dir(tmp_path / "z")), dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    embed, head = torch.randn(V, H, generator=g).double(), torch.randn(V, H, generator=g).double()
    taps = torch.randn(1, 12, 2 * H, generator=g).double()
    one = run(m, taps, torch.tensor([7]), embed, head)
    cache = m.new_cache()
    for a, b in [(0, 5), (5, 6), (6, 12)]:
        m.extend_context(cache, taps[:, a:b])
        m.draft(cache, torch.tensor([3]), embed, head)        # drafting must not change the context cache
    assert cache.length == 12
    inc = m.draft(cache, torch.tensor([7]), embed, head)
    torch.testing.assert_close(inc[0], one[0], rtol=1e-12, atol=1e-12)
    # the block sees the context: changing an old context position changes the draft
    taps2 = taps.clone()
    taps2[:, 0] += 1
    assert not torch.allclose(run(m, taps2, torch.tensor([7]), embed, head)[0], one[0])


def test_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDrafter.from_pretrained(str(tmp_path / "nothing"))
    d = write_zlab_dir(tmp_path / "arch", cfg=zlab_config(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        DFlashDrafter.from_pretrained(str(d))
    w = zlab_weights()
    w.pop("layers.1.mlp.up_proj.weight")
    d = write_zlab_dir(tmp_path / "missing", weights=w)
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        DFlashDrafter.from_pretrained(str(d))
    d = tmp_path / "pickle"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(zlab_config()))
    torch.save(zlab_weights(), d / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        DFlashDrafter.from_pretrained(str(d))


def test_default_tap_layers_when_config_omits_them():
    cfg = zlab_config(num_target_layers=36, num_hidden_layers=5, layer_types=None)
    cfg["dflash_config"] = {"mask_token_id": 199}
    assert DFlashConfig.from_hf_dict(cfg).target_layer_ids == [1, 9, 17, 25, 33]


def _sliding_drafter(path, window: int, seed: int):
    """A float64 drafter whose first layer uses a sliding window, random embedding and LM head, and the generator."""
    cfg = zlab_config(layer_types=["sliding_attention", "full_attention"], sliding_window=window)
    m = DFlashDrafter.from_pretrained(str(write_zlab_dir(path, cfg=cfg)), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g).double(), torch.randn(V, H, generator=g).double()
    return m, embed, head, g


def test_sliding_window_layers_restrict_context(tmp_path):
    m, embed, head, g = _sliding_drafter(tmp_path / "s", window=4, seed=5)
    taps = torch.randn(1, 10, 2 * H, generator=g).double()
    a = run(m, taps, torch.tensor([1]), embed, head)[0]
    assert torch.isfinite(a).all()
    m.layers[0].self_attn.sliding = False
    assert not torch.allclose(run(m, taps, torch.tensor([1]), embed, head)[0], a)


def test_forward_blocks_equals_incremental_draft(tmp_path):
    m, embed, head, g = _sliding_drafter(tmp_path / "b", window=6, seed=6)
    taps = torch.randn(1, 20, 2 * H, generator=g).double()
    seq = torch.randint(0, 190, (20,), generator=g)
    anchors = torch.tensor([1, 4, 11, 19])
    ids = torch.full((4, 8), 199)
    ids[:, 0] = seq[anchors]
    hidden = m.forward_blocks(taps, anchors, embed[ids])
    for a_i, a in enumerate(anchors.tolist()):
        _, h_inc = run(m, taps[:, :a], seq[a:a + 1], embed, head)
        torch.testing.assert_close(hidden[a_i, 1:], h_inc[0], rtol=1e-10, atol=1e-10)
