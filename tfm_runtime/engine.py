"""SpeculativeDecoder: the reference decode loop over Hugging Face targets (batch 1).

  prefill the prompt -> bonus token, DFlash context
  repeat:  DFlash drafts L marginals from the bonus  ->  proposal tree (chain | ddtree | weaver)
           one target pass over the whole tree (ancestor mask; GDN layers via the tree recurrence)
           lossless verification (greedy | target-only | chain sampling | traversal) -> accepted path + bonus
           commit: compact the KV cache, set GDN states to the accepted leaf, feed DFlash the accepted features
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from tfm_runtime.contract import ContractError
from tfm_runtime.hub import check_adapter
from tfm_runtime.models.dflash import DFlashDrafter
from tfm_runtime.models.target import TargetModel
from tfm_runtime.models.tree_target import TreeVerifier
from tfm_runtime.models.weaver import Weaver
from tfm_runtime.sampling import filter_probs
from tfm_runtime.tree import build_chain, build_ddtree
from tfm_runtime.verify import verify_chain_sampling, verify_greedy, verify_target_only, verify_traversal
from tfm_runtime.weaver_tree import build_weaver_tree

PROPOSALS = ("chain", "ddtree", "weaver")
VERIFICATIONS = ("auto", "greedy", "target_only", "chain_sampling", "traversal")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)     # per round: accepted drafts + bonus
    seconds: dict[str, float] = field(default_factory=lambda: Counter())
    tree_sizes: list[int] = field(default_factory=list)
    discarded_rounds: int = 0   # rounds run ahead of the host's reads and not used (tfm_runtime.fast.FastDecoder)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify step, bonus included (docs/method.md §7.1)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(1e-9, sum(self.seconds.values()))

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "verify_steps": self.verify_steps,
                "acceptance_length": round(self.acceptance_length, 4), "histogram": self.histogram,
                "mean_tree_size": sum(self.tree_sizes) / max(1, len(self.tree_sizes)),
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "tokens_per_second": round(self.tokens_per_second, 2)}


@dataclass
class GenerationOutput:
    tokens: list[int]           # new tokens only
    stats: DecodeStats


def finish(new: list[int], stats: DecodeStats, max_new_tokens: int, eos_token_id: int | None) -> GenerationOutput:
    """The emitted tokens cut after the first EOS and at max_new_tokens, with their counts in the stats."""
    if eos_token_id is not None and eos_token_id in new:
        new = new[: new.index(eos_token_id) + 1]
    new = new[:max_new_tokens]
    stats.new_tokens, stats.verify_steps = len(new), len(stats.accept_lengths)
    return GenerationOutput(tokens=new, stats=stats)


def check_models(target: TargetModel, drafter: DFlashDrafter, adapter: Weaver | None) -> None:
    """Raise ContractError naming the first field where the three models disagree."""
    dc = drafter.cfg
    pairs = [("vocab_size", target.vocab_size, dc.vocab_size),
             ("target_hidden_size", target.hidden_size, dc.hidden_size),
             ("num_target_layers", target.num_layers, dc.num_target_layers),
             ("tap_layer_ids", tuple(dc.target_layer_ids), tuple(target.tap_layer_ids))]
    if adapter is not None:
        wc = adapter.cfg
        pairs += [("weaver.d_model", target.hidden_size, wc.d_model),
                  ("weaver.d_embed", target.embed_weight.shape[1], wc.d_embed),
                  ("weaver.lookahead", min(wc.lookahead, dc.block_size - 1), wc.lookahead)]
    for name, expected, actual in pairs:
        if expected != actual:
            raise ContractError(name, expected, actual, "SpeculativeDecoder")


def check_decoder_arguments(target, drafter: DFlashDrafter, adapter: Weaver | None, proposal: str | None,
                            verification: str, tree_budget: int, where: str) -> tuple[TargetModel, str]:
    """A decoder's arguments checked (ValueError, ContractError naming the field) -> (the target as a TargetModel,
    the proposal: Weaver trees when an adapter is given, else DDTree)."""
    if not isinstance(target, TargetModel):
        target = TargetModel(target, drafter.cfg.target_layer_ids)
    proposal = proposal or ("weaver" if adapter is not None else "ddtree")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
    if proposal == "weaver" and adapter is None:
        raise ValueError("proposal='weaver' needs a Weaver adapter (load one with tfm_runtime.load_adapter)")
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    if verification == "chain_sampling" and proposal != "chain":
        raise ValueError(f"verification='chain_sampling' needs proposal='chain' (drafts sampled from DFlash), "
                         f"got proposal={proposal!r}")
    if tree_budget < 1:
        raise ValueError(f"tree_budget must be >= 1, got {tree_budget}")
    check_models(target, drafter, adapter)
    if adapter is not None and adapter.contract is not None:
        check_adapter(adapter.contract, adapter, target=target, drafter=drafter,
                      where=f"{where}: adapter {adapter.source or '(built in code)'}")
    return target, proposal


class SpeculativeDecoder:
    """Speculative decoding of one request at a time with a target, its DFlash drafter and optionally a Weaver.

    `target`: a TargetModel, or a Hugging Face causal LM (wrapped with the drafter's tap layers). The three models
    must agree on their sizes; an adapter with a contract (`load_adapter` sets it) must also have been trained for
    exactly this target and drafter: ids, revisions and tokenizer hash are checked (`tfm_runtime.hub.check_adapter`,
    a `ContractError` names the field). A copy of the contract's model under another name (a local folder) is passed
    as `load_target(ModelSpec(path, id=contract.target_id), taps)` or `TargetModel(model, taps, spec=ModelSpec(path,
    id=contract.target_id))`, and likewise `load_drafter(ModelSpec(path, id=contract.drafter_id))`.

    `verification`: "greedy" (temperature 0 only), "target_only", "chain_sampling" (proposal "chain"), "traversal",
    or "auto" (greedy at temperature 0; traversal for Weaver trees, target-only otherwise). Tree verification runs
    the target's own attention with a 4-D mask: eager or SDPA attention, no sliding-window layers (TreeVerifier).
    """

    def __init__(self, target, drafter: DFlashDrafter, adapter: Weaver | None = None, *, tree_budget: int = 64,
                 proposal: str | None = None, verification: str = "auto", expand: int = 8,
                 width: int | None = None, gdn_backend: str = "auto"):
        target, proposal = check_decoder_arguments(target, drafter, adapter, proposal, verification, tree_budget,
                                                   "SpeculativeDecoder")
        self.target, self.drafter, self.adapter = target, drafter, adapter
        self.tree_budget, self.proposal, self.verification = tree_budget, proposal, verification
        self.expand, self.width = expand, width
        self.verifier = TreeVerifier(target, backend=gdn_backend)

    def _rule(self, temperature: float) -> str:
        if temperature == 0:
            return "greedy"
        if self.verification == "greedy":
            raise ValueError(f"verification='greedy' is lossless only at temperature 0 (it emits the target's argmax, "
                             f"not samples); got temperature {temperature}: use 'auto', 'target_only' or 'traversal'")
        if self.verification != "auto":
            return self.verification
        return "traversal" if self.proposal == "weaver" else "target_only"

    def _tick(self, stats: DecodeStats, stage: str, t0: float) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        stats.seconds[stage] += t1 - t0
        return t1

    def _tree(self, bonus: int, draft_logits, draft_hidden, h_last, temperature, generator):
        """-> (Tree, draft_probs or None)."""
        if self.proposal == "chain":
            sample = self._rule(temperature) == "chain_sampling"
            return build_chain(bonus, draft_logits, self.tree_budget, temperature=temperature if sample else 0.0,
                               generator=generator)
        if self.proposal == "ddtree":
            return build_ddtree(bonus, draft_logits, self.tree_budget), None
        K = min(self.adapter.cfg.candidate_pool, draft_logits.shape[-1])
        cand_logits, cand_ids = draft_logits.topk(K, dim=-1)                             # [L, K]
        t = build_weaver_tree(self.adapter, bonus, h_last, draft_hidden, cand_ids, cand_logits, self.tree_budget,
                              embed_weight=self.target.embed_weight, lm_head_weight=self.target.lm_head_weight,
                              expand=self.expand, width=self.width)
        return t, None

    def _verify(self, rule, tree, logits, draft_probs, temperature, top_k, top_p, generator):
        if rule == "greedy":
            return verify_greedy(tree, logits)
        probs = filter_probs(logits.double(), temperature, top_k, top_p)
        if rule == "target_only":
            return verify_target_only(tree, probs, generator)
        if rule == "traversal":
            return verify_traversal(tree, probs, generator)
        if draft_probs is None:
            raise ValueError("chain_sampling needs proposal='chain' (drafts sampled from DFlash)")
        return verify_chain_sampling(tree, probs, draft_probs, generator)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 seed: int | None = None) -> GenerationOutput:
        """prompt_ids: list[int] or LongTensor [T] -> GenerationOutput(new tokens, stats)."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(self.target.device)
        if prompt.numel() == 0:
            raise ValueError("prompt_ids is empty: the target needs at least one token to start from")
        if generator is None:
            generator = torch.Generator().manual_seed(0 if seed is None else seed)
        rule = self._rule(temperature)
        stats = DecodeStats(prompt_tokens=prompt.numel())
        t = time.perf_counter()
        cache = self.target.new_cache()
        out = self.target(prompt[None], cache=cache, use_cache=True)
        dcache = self.drafter.new_cache()
        self.drafter.extend_context(dcache, out.taps)
        first = filter_probs(out.logits[0, -1:].double(), temperature, top_k, top_p)[0]
        bonus = int(first.argmax()) if temperature == 0 else int(torch.multinomial(first.cpu(), 1, generator=generator))
        h_last, start, new = out.h_final[0, -1], prompt.numel(), [bonus]
        t = self._tick(stats, "prefill", t)
        embed, head = self.target.embed_weight, self.target.lm_head_weight
        while len(new) < max_new_tokens and bonus != eos_token_id:
            draft_logits, draft_hidden = self.drafter.draft(dcache, torch.tensor([bonus], device=prompt.device),
                                                            embed, head)
            t = self._tick(stats, "draft", t)
            tree, draft_probs = self._tree(bonus, draft_logits[0], draft_hidden[0], h_last, temperature, generator)
            t = self._tick(stats, "tree", t)
            dev = self.target.device
            out = self.verifier.verify(cache, tree.tokens.to(dev), tree.parents.to(dev), tree.depths.to(dev),
                                       tree.ancestor_mask().to(dev), start)
            t = self._tick(stats, "verify", t)
            accepted, bonus = self._verify(rule, tree, out.logits[0].cpu(), draft_probs, temperature, top_k, top_p,
                                           generator)
            self.verifier.commit(cache, start, accepted)
            idx = torch.as_tensor(accepted, device=dev)
            self.drafter.extend_context(dcache, out.taps[:, idx])
            h_last, start = out.h_final[0, accepted[-1]], start + len(accepted)
            assert dcache.length == start, (dcache.length, start)
            new += tree.tokens[accepted[1:]].tolist() + [int(bonus)]
            stats.accept_lengths.append(len(accepted))
            stats.tree_sizes.append(tree.num_nodes)
            t = self._tick(stats, "commit", t)
        return finish(new, stats, max_new_tokens, eos_token_id)
