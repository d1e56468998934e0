import pytest
import torch

from tfm_runtime.acceptance import estimate_acceptance, format_table


def test_estimator_rows_and_bounds(worlds64):
    w = worlds64["qwen3"]
    rows = estimate_acceptance(w.target, w.drafter, w.weaver, [[4, 8, 15], [16, 23, 42, 7]], budgets=(1, 16),
                               temperatures=(0.0, 1.0), max_new_tokens=10, progress=False)
    assert [(r.proposal, r.budget, r.temperature) for r in rows] == [
        (p, b, t) for p in ("chain", "ddtree", "weaver") for b in (1, 16) for t in (0.0, 1.0)]
    for r in rows:
        assert 1.0 <= r.acceptance_length <= min(r.budget, w.drafter.lookahead) + 1
        assert r.mean_tree_size <= r.budget + 1 and r.verify_steps >= r.prompts
    assert "accept len" in format_table(rows)
    no_weaver = estimate_acceptance(w.target, w.drafter, None, [[1, 2]], budgets=(4,), temperatures=(0.0,),
                                    max_new_tokens=4, progress=False)
    assert [r.proposal for r in no_weaver] == ["chain", "ddtree"]
    with pytest.raises(ValueError, match="at least one prompt"):
        estimate_acceptance(w.target, w.drafter, w.weaver, [])


def test_oracle_drafter_is_fully_accepted():
    """A drafter whose argmax always equals the target's greedy continuation is accepted to the full block."""
    from tfm_runtime.engine import SpeculativeDecoder
    from tfm_runtime.worlds import tiny_world
    w = tiny_world("llama", dtype=torch.float64, vocab_size=64)
    prompt = [3, 5, 7]
    greedy = w.target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                     min_new_tokens=40, pad_token_id=0, eos_token_id=None)[0].tolist()

    class Oracle:                                     # same interface as DFlashDrafter
        cfg, lookahead = w.drafter.cfg, w.drafter.lookahead

        def new_cache(self):
            return w.drafter.new_cache()

        def extend_context(self, cache, taps):
            w.drafter.extend_context(cache, taps)

        def draft(self, cache, bonus, embed, head):
            pos = cache.length + 1                    # the bonus sits at cache.length
            nxt = greedy[pos:pos + self.lookahead]
            nxt += [0] * (self.lookahead - len(nxt))
            logits = torch.full((1, self.lookahead, 64), -5.0, dtype=torch.float64)
            logits[0, torch.arange(self.lookahead), torch.tensor(nxt)] = 5.0
            return logits, torch.zeros(1, self.lookahead, w.target.hidden_size, dtype=torch.float64)

    dec = SpeculativeDecoder(w.target, Oracle(), None, tree_budget=16, proposal="chain")
    out = dec.generate(prompt, max_new_tokens=30)
    assert out.tokens == greedy[3:33]
    assert out.stats.accept_lengths[:3] == [w.drafter.lookahead + 1] * 3


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_greedy_trajectory_walk_equals_the_decoder(family):
    """The T = 0 shortcut (batched greedy continuations, one teacher-forced pass, lockstep tree walks) gives, for
    every proposal, the decoder's own tokens and per-step accepted lengths, prompts of different lengths together."""
    from tfm_runtime.acceptance import StaticWalkTrees, continuations, trajectory, walk
    from tfm_runtime.engine import SpeculativeDecoder
    from tfm_runtime.worlds import tiny_world
    w = tiny_world(family, dtype=torch.float64)
    prompts, n, L = [[3, 5, 7], [9, 4, 4, 8, 21, 2, 6], [11]], 20, w.drafter.cfg.block_size - 1
    conts = continuations(w.target, prompts, n + L, batch=3)
    for p, c in zip(prompts, conts):
        want = w.target.model.generate(torch.tensor([p]), max_new_tokens=n + L, do_sample=False, min_new_tokens=0,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert c == want                                                      # padding changes nothing
    trajs = [trajectory(w.target, w.drafter, p, n, c) for p, c in zip(prompts, conts)]
    for proposal, budget in [("chain", 7), ("ddtree", 12), ("weaver", 12)]:
        dec = SpeculativeDecoder(w.target, w.drafter, w.weaver if proposal == "weaver" else None,
                                 tree_budget=budget, proposal=proposal)
        walks = walk(dec, trajs, n, eos_token_id=None)
        for p, traj, (accepted, sizes) in zip(prompts, trajs, walks):
            out = dec.generate(p, max_new_tokens=n, temperature=0.0)
            assert out.tokens == traj.tokens[:n]
            assert out.stats.accept_lengths == accepted and out.stats.tree_sizes == sizes, proposal
        if proposal == "weaver":         # the shape-static builder, one row of padding, gives the same walks
            K = min(w.weaver.cfg.candidate_pool, w.target.vocab_size)
            static = StaticWalkTrees(dec, batch=len(prompts) + 1, K=K, L=L)
            assert walk(dec, trajs, n, eos_token_id=None, static=static) == walks
            with pytest.raises(ValueError, match="static tree builder has 2 rows"):
                walk(dec, trajs, n, eos_token_id=None, static=StaticWalkTrees(dec, batch=2, K=K, L=L))


@pytest.mark.gpu
def test_captured_static_walk_equals_the_reference_walk_on_cuda():
    """On CUDA the benchmark's Weaver walks replay one captured build per lockstep step (fewer live rows padded):
    the same per-step acceptance and tree sizes as the reference builder."""
    from tfm_runtime.acceptance import StaticWalkTrees, continuations, trajectory, walk
    from tfm_runtime.engine import SpeculativeDecoder
    from tfm_runtime.worlds import tiny_world
    w = tiny_world("llama", dtype=torch.float32)
    target, drafter, weaver = w.target.to("cuda"), w.drafter.to("cuda"), w.weaver.to("cuda")
    prompts, n, L = [[3, 5, 7], [9, 4, 4, 8, 21, 2, 6], [11]], 24, drafter.cfg.block_size - 1
    conts = continuations(target, prompts, n + L, batch=3)
    trajs = [trajectory(target, drafter, p, n, c) for p, c in zip(prompts, conts)]
    dec = SpeculativeDecoder(target, drafter, weaver, tree_budget=16, proposal="weaver")
    static = StaticWalkTrees(dec, batch=4, K=min(weaver.cfg.candidate_pool, target.vocab_size), L=L)
    assert walk(dec, trajs, n, eos_token_id=None, static=static) == walk(dec, trajs, n, eos_token_id=None)
    assert static.builder._graph is not None                                     # replayed, not rebuilt


def test_sampled_continuations_follow_the_target():
    """At T > 0 each prompt's continuation is a sample of the target: the first token's frequencies over 4000
    copies of one prompt fit filter_probs(logits, T) (chi-square), and not the distribution at another T; the
    second token, given the most frequent first, fits the target's conditional. A prompt's tokens do not depend on
    the batching."""
    from scipy.stats import chisquare
    from tfm_runtime.acceptance import continuations
    from tfm_runtime.sampling import filter_probs
    from tfm_runtime.worlds import tiny_world
    w = tiny_world("llama", dtype=torch.float64, vocab_size=64)
    w.target.model.lm_head.weight.data *= 6.0                  # a peaked target: the temperatures differ clearly
    prompt, N, T = [3, 5, 7], 4000, 0.7
    ys = torch.tensor(continuations(w.target, [prompt] * N, 2, batch=N, temperature=T, seed=1))   # [N, 2]

    def p_value(observed, logits, temp):
        p = filter_probs(logits, temp)
        keep = p * len(observed) >= 5                           # pool the rare tokens into one cell
        counts = torch.bincount(observed, minlength=len(p)).double()
        f_obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
        f_exp = torch.cat([p[keep], p[~keep].sum()[None]]) * len(observed)
        return chisquare(f_obs[f_exp > 0].numpy(), f_exp[f_exp > 0].numpy()).pvalue

    with torch.no_grad():
        first = w.target.model(torch.tensor([prompt])).logits[0, -1]
        mode = int(ys[:, 0].mode().values)
        second = w.target.model(torch.tensor([prompt + [mode]])).logits[0, -1]
    assert p_value(ys[:, 0], first, T) > 1e-3
    assert p_value(ys[:, 0], first, 1.0) < 1e-6                 # the test tells temperatures apart
    assert p_value(ys[ys[:, 0] == mode, 1], second, T) > 1e-3
    prompts = [[3, 5, 7], [9, 4, 4, 8, 21, 2, 6], [11]]
    together = continuations(w.target, prompts, 12, batch=3, temperature=1.0, seed=5)
    assert together == [continuations(w.target, [p], 12, batch=1, temperature=1.0, seed=5 + i)[0]
                        for i, p in enumerate(prompts)]
    assert together != continuations(w.target, prompts, 12, batch=3, temperature=1.0, seed=6)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_sampled_trajectory_walk_equals_the_decoder_at_t1(family):
    """At T = 1 under target-only verification the decoder emits a target sample path, and walking that path
    gives its per-step accepted lengths and tree sizes, for every proposal: the shortcut of the T = 1 rows. A
    12-token vocabulary makes the random tiny drafter accepted often. Traversal verification is refused."""
    from tfm_runtime.acceptance import trajectory, walk
    from tfm_runtime.engine import SpeculativeDecoder
    from tfm_runtime.worlds import tiny_world
    w = tiny_world(family, dtype=torch.float64, vocab_size=12, candidate_pool=8)
    prompts, n, L = [[3, 5, 7], [9, 4, 4, 8, 1, 2, 6], [11]], 24, w.drafter.cfg.block_size - 1
    seen = []
    for proposal, budget in [("chain", 7), ("ddtree", 8), ("weaver", 12)]:
        dec = SpeculativeDecoder(w.target, w.drafter, w.weaver if proposal == "weaver" else None,
                                 tree_budget=budget, proposal=proposal, verification="target_only")
        for seed, p in enumerate(prompts):
            out = dec.generate(p, max_new_tokens=n + L, temperature=1.0, generator=torch.Generator().manual_seed(seed))
            traj = trajectory(w.target, w.drafter, p, n, out.tokens)
            [(accepted, sizes)] = walk(dec, [traj], n, eos_token_id=None, temperature=1.0)
            assert out.stats.accept_lengths[:len(accepted)] == accepted, proposal
            assert out.stats.tree_sizes[:len(sizes)] == sizes, proposal
            seen += accepted
    assert {1, 2} <= set(seen), "the walks must see steps with and without an accepted draft token"
    traversal = SpeculativeDecoder(w.target, w.drafter, w.weaver, tree_budget=12, proposal="weaver")
    with pytest.raises(ValueError, match="'traversal' at temperature 1.0"):
        walk(traversal, [traj], n, eos_token_id=None, temperature=1.0)
