"""The Triton GDN tree path plugged into the decoder (hybrid targets): same outputs as the torch reference path,
greedy tokens equal to Hugging Face generate. Runs under TRITON_INTERPRET=1 on CPU (tiny shapes) or on CUDA."""
import os

import pytest
import torch

from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.models.tree_target import TreeVerifier
from tfm_runtime.worlds import HYBRID_FAMILIES, tiny_world

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")


DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def world(request):
    w = tiny_world(request.param, dtype=torch.float32, seed=5)
    for m in (w.target, w.drafter, w.weaver):
        m.to(DEV)
    return w


def test_tree_pass_and_commit_match_torch_path(world):
    t = world.target
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (9,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6, 7, 3])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 5, 3])
    tokens = torch.randint(0, 250, (10,), generator=g)
    anc = torch.zeros(10, 10, dtype=torch.bool)
    for i in range(10):
        j = i
        while j >= 0:
            anc[i, j], j = True, int(parents[j])
    outs = {}
    for backend in ("torch", "triton"):
        v = TreeVerifier(t, backend=backend)
        cache = t.new_cache()
        t(prompt[None].to(DEV), cache=cache, use_cache=True)
        before = [layer.recurrent_states[0].clone() for layer in cache.layers if hasattr(layer, "recurrent_states")]
        o1 = v.verify(cache, tokens, parents, depths, anc, 9)
        after = [layer.recurrent_states[0] for layer in cache.layers if hasattr(layer, "recurrent_states")]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "verify wrote the committed state"
        v.commit(cache, 9, [0, 1, 3, 6, 7])
        o2 = v.verify(cache, tokens[:3], torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]),
                      torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), 14)
        outs[backend] = (o1.logits, o2.logits)
    for a, b in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_with_triton_gdn_equals_hf(world):
    prompt = [7, 100, 31, 5]
    ref = world.target.model.generate(torch.tensor([prompt], device=DEV), max_new_tokens=4, min_new_tokens=4,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)[0, 4:].tolist()
    dec = SpeculativeDecoder(world.target, world.drafter, world.weaver, tree_budget=8, gdn_backend="triton")
    assert dec.verifier.backend == "triton"
    assert dec.generate(prompt, max_new_tokens=4).tokens == ref
