"""The sampling check both fast models share: FastDecoder against the reference SpeculativeDecoder at T > 0."""
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.fast import FastDecoder


def assert_sampling_equals_reference(world, prompt, proposal, verification, *, budget, max_seq_len, new_tokens):
    """With one seed both decoders draw the same random numbers in the same order: the same tokens and accepted
    lengths; two seeds give two different samples."""
    adapter = world.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=budget, proposal=proposal, verification=verification)
    fast = FastDecoder(world.target, world.drafter, adapter, max_seq_len=max_seq_len, **kw)
    ref = SpeculativeDecoder(world.target, world.drafter, adapter, **kw)
    runs = []
    for seed in (0, 1):
        a = fast.generate(prompt, max_new_tokens=new_tokens, temperature=1.0, top_k=6, seed=seed)
        b = ref.generate(prompt, max_new_tokens=new_tokens, temperature=1.0, top_k=6, seed=seed)
        assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths, seed
        runs.append(a.tokens)
    assert runs[0] != runs[1]                                # the seed matters: these are samples
