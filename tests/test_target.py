import pytest
import torch

from tfm_runtime.models.target import TargetModel, default_tap_layers
from tfm_runtime.worlds import FAMILIES, HYBRID_FAMILIES, tiny_target


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_equal_hf_hidden_states(family):
    taps = [0, 2, 4]
    t = tiny_target(family, dtype=torch.float64, tap_layer_ids=taps)
    assert t.is_hybrid == (family in HYBRID_FAMILIES)
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(1))
    out = t(ids)
    ref = t.model(ids, output_hidden_states=True)
    H = t.hidden_size
    assert out.taps.shape == (2, 11, len(taps) * H)
    for j, i in enumerate(taps):
        torch.testing.assert_close(out.taps[..., j * H:(j + 1) * H], ref.hidden_states[i + 1], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.h_final @ t.lm_head_weight.T, ref.logits, rtol=1e-12, atol=1e-12)
    assert t.embed_weight.shape == (t.vocab_size, H) and t.lm_head_weight.shape == (t.vocab_size, H)
    torch.testing.assert_close(t.embed(ids[:, :1])[:, 0], t.embed_weight[ids[:, 0]])


def test_bad_tap_layer_rejected():
    t = tiny_target("llama")
    with pytest.raises(ValueError, match=r"tap layer ids must be in \[0, 5\]"):
        TargetModel(t.model, [6])


def test_default_tap_layers_match_dflash():
    assert default_tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_tap_layers(64, 5) == [1, 16, 31, 46, 61]
    assert default_tap_layers(32, 5) == [1, 8, 15, 22, 29]
    assert default_tap_layers(28, 1) == [14]
