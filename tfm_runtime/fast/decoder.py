"""FastDecoder: SpeculativeDecoder's loop on a compact target (DenseModel; HybridModel for GDN hybrids), static caches.

  prefill the prompt (static cache) -> bonus token, DFlash context (StaticDFlash: static context cache)
  repeat:  DFlash drafts L marginals from the bonus  ->  proposal tree (chain | ddtree | weaver)
           (shape-static builders on the device, no host reads; sampled chains: the reference builder)
           DenseModel.verify_tree: one pass writing the nodes' K/V after the committed prefix
           acceptance -> the accepted path, its length A, its leaf and the bonus, in `accept_dev`:
             T = 0 (static builders): on the device (`tfm_kernels.greedy_accept`), nothing read first
             T > 0: the reference's verification rules on the host, the result copied in
           commit (`_commit_ops`; with CUDA graphs one replay for any A): the accepted nodes' K/V move into place
           (hybrid: the GDN states after the leaf), DFlash extends its context with their taps, the leaf's hidden
           state, the bonus and the committed length stay on the device for the next round

At T = 0 a round needs nothing from the host, so on CUDA rounds are queued one ahead of the host's reads: the host reads
round r (the tree, the target's argmax per node and the accepted path, one copy), checks it and extends the output
while the device runs round r + 1. A round queued past the end of the request is discarded. A Weaver tree whose build
ran its first phase only and left it unfinished (rare, see StaticWeaverTreeBuilder) commits nothing (`hold`), so the
round queued after it starts from the same state and builds the same tree; the host then finishes that tree, verifies
it again and commits it.

Drafting, sampled chains, verification rules, sampling order and statistics are the reference decoder's own
(tfm_runtime.engine); greedy chains, DDTrees and Weaver trees come from StaticChainBuilder, StaticDDTreeBuilder and
StaticWeaverTreeBuilder, which build the reference's trees. So for the same inputs and generator both decoders emit
the same tokens.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from tfm_kernels.greedy_accept import greedy_accept, greedy_accept_ref
from tfm_runtime.engine import DecodeStats, GenerationOutput, SpeculativeDecoder, check_decoder_arguments, finish
from tfm_runtime.fast.ddtree import StaticChainBuilder, StaticDDTreeBuilder
from tfm_runtime.fast.dense import DenseModel
from tfm_runtime.fast.dflash import StaticDFlash
from tfm_runtime.fast.graphs import GraphedTarget, capture
from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, ancestor_masks
from tfm_runtime.models.common import kernel_device
from tfm_runtime.models.dflash import DFlashDrafter
from tfm_runtime.models.weaver import Weaver
from tfm_runtime.sampling import filter_probs
from tfm_runtime.tree import Tree
from tfm_runtime.verify import verify_greedy_best


class FastDecoder:
    """Speculative decoding of one request at a time, with SpeculativeDecoder's arguments and `generate` API.

    `target`: a TargetModel or a Hugging Face causal LM: Llama or Qwen3 dense (a `DenseModel`), or a Qwen3-Next /
    Qwen3.5 hybrid with GDN layers (a `HybridModel`). Its weights are shared with that model, whose KV cache holds
    `max_seq_len` slots (default: the model's max_position_embeddings, at most 4096); a request needs prompt +
    max_new_tokens + tree_budget slots. `gdn_backend`: the hybrid model's GDN backend (see HybridModel).
    `attention`: see DenseModel.
    `cuda_graphs`: on CUDA, replay tree verify (every tree padded to the largest tree size), decode, the DFlash
    draft, the device-side acceptance with the host read's packing, and the whole commit stage (one graph for every
    accepted path length) from CUDA graphs captured here (tfm_runtime.fast.graphs, StaticDFlash, `_capture_commit`),
    and the tree build from a graph captured at its first build; ignored on the CPU.
    Greedy chains and DDTrees: one StaticChainBuilder / StaticDDTreeBuilder built here. Weaver trees: one
    StaticWeaverTreeBuilder (batch 1) built here, `weaver_rounds` its round count (default: the worst case, so every
    tree is the reference's, in two phases of which the second runs only for trees that need it; fewer rounds may
    cut trees short, see tfm_runtime.fast.weaver_tree).
    `profile`: time each stage (prefill, draft, tree, verify, commit in `stats.seconds`) with a device sync after
    each, one round at a time; off, the loop's time is recorded as `step` and, at T = 0 on CUDA, rounds run one
    ahead of the host's reads (module docstring; `stats.discarded_rounds` counts the rounds run and not used).
    """

    # the reference decoder's rule choice, tree building, verification and stage timing, unchanged
    _rule = SpeculativeDecoder._rule
    _tree = SpeculativeDecoder._tree
    _verify = SpeculativeDecoder._verify

    # the stage that follows a stage of a round (profiled runs mark each stage as a profiler range; the prefill
    # and each round's draft open theirs in `generate`)
    NEXT_STAGE = {"draft": "tree", "tree": "verify", "verify": "commit"}

    def _tick(self, stats: DecodeStats, stage: str, t0: float) -> float:
        """Add the time since t0 to `stage` (synchronised: profiled stages, the prefill and the AR loop), else to
        `step`. With `profile`, each stage of `generate` also runs inside a `torch.profiler.record_function` range
        "tfm.<stage>", so that a torch.profiler trace attributes every kernel to its stage
        (`benchmarks.runtime.runtime_bench --trace`)."""
        if self.profile or stage in ("prefill", "decode"):
            t1 = SpeculativeDecoder._tick(self, stats, stage, t0)
            if self.profile:
                self._stage_range(self.NEXT_STAGE.get(stage))
            return t1
        t1 = time.perf_counter()
        stats.seconds["step"] += t1 - t0
        return t1

    def _stage_range(self, stage: str | None) -> None:
        """With `profile`: close the open profiler range of `generate` (if any) and open "tfm.<stage>" (none for
        None)."""
        if not self.profile:
            return
        if self._open_range is not None:
            self._open_range.__exit__(None, None, None)
            self._open_range = None
        if stage is not None:
            self._open_range = torch.profiler.record_function(f"tfm.{stage}")
            self._open_range.__enter__()

    def __init__(self, target, drafter: DFlashDrafter, adapter: Weaver | None = None, *, tree_budget: int = 64,
                 proposal: str | None = None, verification: str = "auto", expand: int = 8,
                 width: int | None = None, gdn_backend: str = "auto", max_seq_len: int | None = None,
                 attention: str = "auto", cuda_graphs: bool = False, weaver_rounds: int | None = None,
                 profile: bool = False):
        target, proposal = check_decoder_arguments(target, drafter, adapter, proposal, verification, tree_budget,
                                                   "FastDecoder")
        if max_seq_len is None:
            max_seq_len = min(getattr(target.config, "max_position_embeddings", None) or 4096, 4096)
        self.target, self.drafter, self.adapter = target, drafter, adapter
        self.tree_budget, self.proposal, self.verification = tree_budget, proposal, verification
        self.expand, self.width, self.profile = expand, width, profile
        self._open_range = None                       # the profiler range of the running stage (`profile`)
        if target.is_hybrid:
            from tfm_runtime.fast.hybrid import HybridModel
            self.model = HybridModel.from_hf(target.model, target.tap_layer_ids, max_seq_len=max_seq_len,
                                             attention=attention, gdn=gdn_backend)
        else:
            self.model = DenseModel.from_hf(target.model, target.tap_layer_ids, max_seq_len=max_seq_len,
                                            attention=attention)
        # the largest tree a round builds: a chain stops at the drafter's lookahead
        self.max_nodes = (min(tree_budget, drafter.lookahead) if proposal == "chain" else tree_budget) + 1
        self.runner = GraphedTarget(self.model, (self.max_nodes,)) if cuda_graphs else self.model
        self.dflash = StaticDFlash(drafter, self.model.embed, self.model.lm_head, self.model.max_seq_len,
                                   cuda_graphs=cuda_graphs)
        self.weaver_builder = None
        sizes = (tree_budget, drafter.lookahead, target.vocab_size, self.model.device)
        self.ddtree_builder = StaticDDTreeBuilder(*sizes) if proposal == "ddtree" else None
        self.chain_builder = StaticChainBuilder(*sizes) if proposal == "chain" else None   # greedy chains
        if proposal == "weaver":
            K = min(adapter.cfg.candidate_pool, target.vocab_size)
            self.weaver_builder = StaticWeaverTreeBuilder(
                adapter, target.embed_weight, target.lm_head_weight, tree_budget, K=K, L=drafter.lookahead, batch=1,
                expand=expand, width=width, rounds=weaver_rounds, device=self.model.device, dtype=self.model.dtype)
        # graphed verify pads every tree to max_nodes anyway: then static trees go in padded, no host read first
        self.pad_trees = isinstance(self.runner, GraphedTarget) and self.runner.enabled
        self.capture_trees = cuda_graphs and self.model.device.type == "cuda"
        self._graphs: dict[tuple, tuple] = {}            # (what, its buffers) -> (graph, outputs) (`_replayed`)
        self._cand: tuple[torch.Tensor, torch.Tensor] | None = None   # DFlash's top-K (values, ids) [L, K]
        # the round's device-side state: the accepted path (node ids padded with 0 to amax, A, leaf, bonus), the
        # committed length, the last accepted node's hidden state
        dev = self.model.device
        self.amax = min(drafter.lookahead + 1, self.max_nodes)                  # the longest accepted path
        self.accept_dev = torch.zeros(self.amax + 3, dtype=torch.long, device=dev)          # [amax + 3]
        self.accept_host = torch.zeros(self.amax + 3, dtype=torch.long)                     # T > 0: the host's
        if dev.type == "cuda":
            self.accept_host = self.accept_host.pin_memory()
        self.start_dev = torch.zeros(1, dtype=torch.long, device=dev)           # [1]
        self.h_last = torch.zeros(self.model.embed.shape[-1], dtype=self.model.dtype, device=dev)  # [H]
        # greedy rounds queued ahead of the host's reads: one on CUDA, none on the CPU (its ops run as they are
        # called, so a round queued ahead only risks being discarded)
        self.rounds_ahead = 1 if dev.type == "cuda" else 0
        self._readouts: list[torch.Tensor] = []       # pinned host buffers of the rounds in flight (a ring)
        self._next_readout = 0
        self.commit_graph: torch.cuda.CUDAGraph | None = None      # the commit stage, any accepted length
        if self.pad_trees and self.dflash.graphs:
            self._capture_commit()

    def _prompt(self, prompt_ids, max_new_tokens: int, tree_nodes: int) -> torch.Tensor:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(self.model.device)
        if prompt.numel() == 0:
            raise ValueError("prompt_ids is empty: the target needs at least one token to start from")
        # the last round starts with at most prompt + max_new_tokens - 2 committed tokens and writes its tree after
        need = prompt.numel() + max_new_tokens + tree_nodes - 2
        if need > self.model.max_seq_len:
            raise ValueError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) + tree nodes "
                             f"({tree_nodes}) need {need} cache slots; the static cache has max_seq_len="
                             f"{self.model.max_seq_len} (pass a larger max_seq_len to FastDecoder)")
        return prompt

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 seed: int | None = None) -> GenerationOutput:
        """prompt_ids: list[int] or LongTensor [T] -> GenerationOutput(new tokens, stats), as SpeculativeDecoder."""
        prompt = self._prompt(prompt_ids, max_new_tokens, self.max_nodes)
        if generator is None:
            generator = torch.Generator().manual_seed(0 if seed is None else seed)
        rule = self._rule(temperature)
        stats = DecodeStats(prompt_tokens=prompt.numel())
        self._stage_range("prefill")
        t = time.perf_counter()
        out = self.model.prefill(prompt)
        self.dflash.prefill(out.taps)
        first = filter_probs(out.logits.double(), temperature, top_k, top_p)[0]
        bonus = int(first.argmax()) if temperature == 0 else int(torch.multinomial(first.cpu(), 1, generator=generator))
        # each round reads its bonus, committed length and h_last from fixed device buffers (then the commit's)
        self.start_dev.fill_(prompt.numel())
        self.accept_dev[-1:].fill_(bonus)
        self.dflash.block[:1].fill_(bonus)
        self.h_last.copy_(out.hidden[-1])
        t = self._tick(stats, "prefill", t)
        # chains sampled from DFlash (chain_sampling) come from the reference builder, with its random draws
        static = self.weaver_builder or self.ddtree_builder or (self.chain_builder if rule != "chain_sampling"
                                                                else None)
        new = [bonus]
        if rule == "greedy":
            self._greedy_rounds(static, prompt.numel(), new, stats, max_new_tokens, eos_token_id, t)
        else:
            self._sampled_rounds(static, rule, new, stats, max_new_tokens, eos_token_id, t, temperature, top_k,
                                 top_p, generator)
        self._stage_range(None)
        return finish(new, stats, max_new_tokens, eos_token_id)

    # ---- T = 0: rounds on the device, read one round late --------------------------------------------------
    def _greedy_rounds(self, b, start: int, new: list[int], stats: DecodeStats, max_new_tokens: int,
                       eos_token_id: int | None, t: float) -> None:
        """Greedy rounds with static builder b from `start` committed tokens, extending `new`. Up to `lag` + 1 rounds
        are in flight: a round is queued while the host reads the one before (lag `rounds_ahead`; 0 with `profile`),
        when the output may still need it and its tree fits the cache however long the paths in flight are."""
        lag, hold = (0 if self.profile else self.rounds_ahead), self._deferred(b)
        pending: deque[tuple[torch.Tensor, object]] = deque()          # readouts of queued rounds, oldest first
        held = False                                                   # the last round read committed nothing
        while len(new) < max_new_tokens and new[-1] != eos_token_id:
            while (not held and len(pending) <= lag and len(new) + len(pending) < max_new_tokens
                   and start + len(pending) * self.amax + self.max_nodes <= self.model.max_seq_len):
                readout, t = self._queue_round(b, hold, stats, t)
                pending.append(readout)
            if pending:
                A = self._take(pending.popleft(), new, stats)
                held = A == 0
                stats.discarded_rounds += held
                start += A
            elif held:                 # the rounds in flight held an unfinished tree: finish it, verify it again
                readout, t = self._finish_round(b, stats, t)
                start += self._take(readout, new, stats)
                held = False
            else:
                raise RuntimeError(f"internal: no round fits the cache after {start} committed tokens")
            t = self._tick(stats, "commit", t)
        stats.discarded_rounds += len(pending)
        if pending and pending[-1][1] is not None:    # the device's time for rounds run ahead counts as the loop's
            pending[-1][1].synchronize()
            self._tick(stats, "commit", t)

    def _queue_round(self, b, hold: bool, stats: DecodeStats, t: float):
        """Queue one greedy round (nothing read on the host): draft, build, then `_verified`. hold: an unfinished
        tree commits nothing. -> (its readout, the tick's time)."""
        self._stage_range("draft")
        draft_logits, draft_hidden = self.dflash.draft(None)                   # [L, V], [L, H] after the bonus
        t = self._tick(stats, "draft", t)
        trees, nodes = self._static_tree(b, self.accept_dev[-1:], draft_logits, draft_hidden, self.h_last)
        return self._verified(trees, nodes, hold, stats, self._tick(stats, "tree", t))

    def _finish_round(self, b, stats: DecodeStats, t: float):
        """The builder's last (held) tree finished by its second phase, then `_verified`."""
        trees = b.finish()
        return self._verified(trees, self._nodes(trees), False, stats, self._tick(stats, "tree", t))

    def _verified(self, trees, nodes, hold: bool, stats: DecodeStats, t: float):
        """A built tree verified, accepted on the device and committed -> (its readout, the tick's time)."""
        out = self.runner.verify_tree(*nodes, self.start_dev)
        readout = self._accept(trees, out, hold)
        t = self._tick(stats, "verify", t)
        self._commit(out)
        return readout, self._tick(stats, "commit", t)

    def _take(self, readout, new: list[int], stats: DecodeStats) -> int:
        """Wait for a queued round's readout; unless it was held, check it (the `Tree` is validated and the greedy
        verifier's path on the host must be the device's) and add its tokens and statistics. -> A (0: held)."""
        host, event = readout
        if event is not None:
            event.synchronize()
        packed, acc = self._split_readout(host)
        A, _, bonus = acc[self.amax:].tolist()
        if A == 0:
            return 0
        tree, best, _ = self._unpack(packed)
        path, want = verify_greedy_best(tree, best)
        if path != acc[:A].tolist() or want != bonus:
            raise RuntimeError(f"internal: the device accepted {acc[:A].tolist()} + {bonus}, the greedy verifier "
                               f"{path} + {want}")
        new += tree.tokens[path[1:]].tolist() + [bonus]
        stats.accept_lengths.append(A)
        stats.tree_sizes.append(tree.num_nodes)
        return A

    def _accept(self, trees, out, hold: bool):
        """The device-side acceptance of a verified tree and its readout: `accept_dev` written, then the tree, the
        target's argmax per node and `accept_dev` copied to a pinned host buffer. -> (host buffer, CUDA event or
        None). With padded trees from captured builders and the verify graph's outputs (fixed buffers), one replay
        of a graph of its own."""
        fixed = self.pad_trees and self.capture_trees and out.logits.data_ptr() == self._padded_out().logits.data_ptr()
        if fixed:
            dev_buf = self._replayed(("accept", trees.tokens.data_ptr(), out.logits.data_ptr(), hold),
                                     lambda: self._accept_ops(trees, out.logits, hold))
        else:
            dev_buf = self._accept_ops(trees, out.logits, hold)
        if len(self._readouts) != 3 or self._readouts[0].shape != dev_buf.shape:
            # three: a buffer is rewritten only after the host has read it (at most two rounds are in flight)
            self._readouts = [torch.empty(dev_buf.shape, dtype=dev_buf.dtype, pin_memory=dev_buf.is_cuda)
                              for _ in range(3)]
        host = self._readouts[self._next_readout]
        self._next_readout = (self._next_readout + 1) % len(self._readouts)
        host.copy_(dev_buf, non_blocking=True)
        event = None
        if dev_buf.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return host, event

    def _accept_ops(self, trees, logits: torch.Tensor, hold: bool) -> torch.Tensor:
        """Device ops, no host reads: the greedy path of the verified tree (row 0 of `trees`, logits [n, V] in node
        order) into `accept_dev` (hold: an unfinished tree accepts nothing), then the readout [6 (N+1) + amax + 3]:
        `_pack`'s rows and `accept_dev`."""
        n = logits.shape[0]
        best = logits.argmax(-1)                                                            # [n]
        args = (trees.tokens[:, :n], trees.parents[:, :n], best[None], trees.num_nodes, self.amax,
                trees.truncated if hold else None)
        if kernel_device(best):
            greedy_accept(*args, out=self.accept_dev[None])
        else:
            self.accept_dev.copy_(greedy_accept_ref(*args)[0])
        return torch.cat([self._pack(trees, best).flatten(), self.accept_dev])

    def _split_readout(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A readout -> (`_pack`'s rows [6, N+1], the accepted path [amax + 3])."""
        W = host.numel() - self.amax - 3
        return host[:W].view(6, W // 6), host[W:]

    # ---- T > 0: the reference's verification on the host ----------------------------------------------------
    def _sampled_rounds(self, static, rule: str, new: list[int], stats: DecodeStats, max_new_tokens: int,
                        eos_token_id: int | None, t: float, temperature, top_k, top_p, generator) -> None:
        """Sampled rounds, one at a time: the verified tree goes to the host, the reference's rule accepts a path
        with the generator's draws, and the path goes back for the commit."""
        while len(new) < max_new_tokens and new[-1] != eos_token_id:
            self._stage_range("draft")
            draft_logits, draft_hidden = self.dflash.draft(None)                   # [L, V], [L, H]
            t = self._tick(stats, "draft", t)
            if static is None:
                tree, draft_probs = self._tree(new[-1], draft_logits, draft_hidden, self.h_last, temperature,
                                               generator)
                nodes = (tree.tokens.to(self.model.device), tree.depths.to(self.model.device),
                         tree.ancestor_mask().to(self.model.device))
            else:
                draft_probs = None
                trees, nodes = self._static_tree(static, self.accept_dev[-1:], draft_logits, draft_hidden,
                                                 self.h_last)
            t = self._tick(stats, "tree", t)
            out = self.runner.verify_tree(*nodes, self.start_dev)
            if static is not None:                            # the tree on the host, for the verify rules
                packed = self._read_packed(trees)
                if self._truncated(packed) and self._deferred(static):   # rare: the Weaver tree needs its 2nd phase
                    trees = static.finish()
                    out = self.runner.verify_tree(*self._nodes(trees), self.start_dev)
                    packed = self._read_packed(trees)
                tree = self._unpack(packed)[0]
            t = self._tick(stats, "verify", t)
            accepted, bonus = self._verify(rule, tree, out.logits[:tree.num_nodes].cpu(), draft_probs, temperature,
                                           top_k, top_p, generator)
            A, h = len(accepted), self.accept_host
            h.zero_()
            h[:A] = torch.as_tensor(accepted)
            h[self.amax:] = torch.tensor([A, accepted[-1], int(bonus)])
            self.accept_dev.copy_(h, non_blocking=True)   # pinned on CUDA; rewritten after the next round's read
            self._commit(out)
            new += tree.tokens[accepted[1:]].tolist() + [int(bonus)]
            stats.tree_sizes.append(tree.num_nodes)
            stats.accept_lengths.append(A)
            t = self._tick(stats, "commit", t)

    # ---- the commit -----------------------------------------------------------------------------------------
    def _commit(self, out) -> None:
        """The commit of the path in `accept_dev` after the verify that gave `out`: one replay of the commit graph
        (trees verified padded in the graph of max_nodes), else its ops."""
        if self.commit_graph is not None:
            if out.hidden.data_ptr() != self._padded_out().hidden.data_ptr():
                raise RuntimeError("internal: the tree was not verified in the graph of the padded size")
            self.commit_graph.replay()
        else:
            self._commit_ops(out)
        if isinstance(self.runner, GraphedTarget):
            self.runner.committed()

    def _capture_commit(self) -> None:
        """The CUDA graph of the commit stage (`_commit_ops`) for any accepted length, reading the outputs of the
        verify graph at max_nodes (every tree goes in padded to it): one replay where the eager stage takes about
        fifteen launches. Captured before any request: the warm-up runs write slots at the end of the target's
        cache, DFlash context slots and GDN states, all of which the next prefill resets."""
        m, d, A = self.model, self.dflash, self.amax
        out, tail = self._padded_out(), m.max_seq_len - self.max_nodes
        length = d.length.clone()
        self.accept_dev[:A].copy_(torch.arange(A, device=m.device))
        self.accept_dev[A:].copy_(torch.tensor([A, A - 1, 0], device=m.device))

        def warm():
            self.start_dev.fill_(tail)
            d.length.zero_()
            self._commit_ops(out)
        self.commit_graph = capture(lambda: self._commit_ops(out), warm=warm)[0]
        d.length.copy_(length)
        self.runner.committed()

    def _commit_ops(self, out) -> None:
        """The commit stage as device ops with no host values: the target keeps the path in `accept_dev` (its
        first A node ids; the padding moves K/V only into slots past the committed prefix) of the tree verified after
        `start_dev` committed tokens (K/V; hybrid: the GDN states after the leaf, none when A = 0), DFlash extends
        its context by the path's A taps, the leaf's hidden state becomes `h_last` (kept when A = 0), `start_dev`
        grows by A and the bonus goes into DFlash's block for the next draft.
        out: the verify's DenseOutput (hidden [n, H], taps [n, F])."""
        d, A = self.dflash, self.amax
        path, count, leaf = self.accept_dev[:A], self.accept_dev[A:A + 1], self.accept_dev[A + 1:A + 2]
        if isinstance(self.runner, GraphedTarget):
            self.runner.commit_ops(self.max_nodes, self.start_dev, path, leaf)
        else:
            DenseModel.commit(self.model, self.start_dev, path)
            if hasattr(self.model, "commit_states"):
                self.model.commit_states(leaf)
        d.taps_in[:A].copy_(out.taps.index_select(0, path))                             # [amax, F]
        d.count.copy_(count)
        d._extend()
        h = out.hidden.index_select(0, leaf.clamp(min=0))[0]                            # [H] the leaf's
        self.h_last.copy_(torch.where(count > 0, h, self.h_last))
        self.start_dev.add_(count)
        d.block[:1].copy_(self.accept_dev[-1:])                                         # the next round's bonus

    # ---- trees ----------------------------------------------------------------------------------------------
    def _static_tree(self, b, root: torch.Tensor, draft_logits, draft_hidden, h_last):
        """b: the static chain, DDTree or Weaver builder; root [1] long (the bonus token on the device);
        draft_logits [L, V], draft_hidden [L, H], h_last [H] ->
        (WeaverTrees of one row [1, N+1], the tree's (tokens [n], depths [n], ancestor mask [n, n]) on the device).
        n = N + 1 (padding nodes see only themselves) when the verify pads trees anyway, else the tree's node count
        (read on the host)."""
        if b is self.weaver_builder:
            if self._cand is None:                        # the candidates go to fixed buffers, made once
                self._cand = tuple(draft_logits.topk(b.K, dim=-1))                         # values, ids [L, K]
            else:
                torch.topk(draft_logits, b.K, dim=-1, out=self._cand)
            values, ids = self._cand
            inputs = (root, h_last[None], draft_hidden[None], ids[None], values[None])
        else:
            inputs = (root, draft_logits)
        if self.capture_trees and b._graph is None:       # the graph reads these fixed buffers: nothing to copy
            b.capture(*inputs, alias=True)
        trees = b.build(*inputs, finish=not self._deferred(b)) if b is self.weaver_builder else b.build(*inputs)
        return trees, self._nodes(trees)

    def _deferred(self, b) -> bool:
        """Whether builder b's second phase waits for the host's read of `truncated`: a Weaver build with two phases
        whose trees go to the verify padded, i.e. with no host read before it."""
        return b is self.weaver_builder and self.pad_trees and b.first_rounds < b.rounds

    def _nodes(self, trees):
        """-> the tree's (tokens [n], depths [n], ancestor mask [n, n]) on the device (see `_static_tree`). Padded
        trees from captured builders (fixed buffers) get their ancestor mask from a CUDA graph of its own."""
        n = trees.tokens.shape[1] if self.pad_trees else int(trees.num_nodes[0])
        parents = trees.parents[:, :n]                                                      # [1, n]
        if not (self.pad_trees and self.capture_trees):
            return trees.tokens[0, :n], trees.depths[0, :n], ancestor_masks(parents, self.drafter.lookahead)[0]
        anc = self._replayed(("anc", parents.data_ptr()),
                             lambda: ancestor_masks(parents, self.drafter.lookahead)[0])             # [n, n]
        return trees.tokens[0, :n], trees.depths[0, :n], anc

    def _replayed(self, key: tuple, fn):
        """fn()'s outputs from a CUDA graph of fn, captured at the first call with this key (fn reads fixed buffers
        only, which the key names)."""
        if key not in self._graphs:
            self._graphs[key] = capture(fn, runs=1)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _padded_out(self):
        """The verify graph's static outputs at max_nodes (every tree goes in padded to it with CUDA graphs)."""
        return self.runner.graphs[self.max_nodes][2]

    # ---- the host's view of a tree ------------------------------------------------------------------------------
    @staticmethod
    def _pack(trees, best: torch.Tensor | None) -> torch.Tensor:
        """Row 0 of `trees` and, given the target's argmax per node best [n] (n <= N+1, node order), as one long
        tensor [5 or 6, N+1] on the device: tokens, parents, depths, log q (its float64 bits), (num_nodes,
        truncated), argmax."""
        count = torch.stack([trees.num_nodes[0], trees.truncated[0].long()])           # [2]
        rows = [trees.tokens[0], trees.parents[0], trees.depths[0], trees.draft_logprobs[0].view(torch.long),
                torch.nn.functional.pad(count, (0, trees.tokens.shape[1] - 2))]         # 5 x [N+1]
        if best is not None:
            rows.append(torch.nn.functional.pad(best, (0, rows[0].numel() - best.numel())))
        return torch.stack(rows)                                                       # [5 or 6, N+1]

    @staticmethod
    def _unpack(host: torch.Tensor) -> tuple[Tree, torch.Tensor | None, bool]:
        """`_pack`'s tensor, on the host -> (Tree, argmax [num_nodes] or None, truncated)."""
        n, truncated = host[4, :2].tolist()
        tree = Tree(tokens=host[0, :n], parents=host[1, :n], depths=host[2, :n],
                    draft_logprobs=host[3, :n].view(torch.float64))
        return tree, (host[5, :n] if host.shape[0] > 5 else None), bool(truncated)

    @staticmethod
    def _truncated(host: torch.Tensor) -> bool:
        """`_pack`'s tensor, on the host -> whether the tree is `truncated`."""
        return bool(host[4, 1])

    def _read_packed(self, trees) -> torch.Tensor:
        """`_pack`'s tensor (no argmax) on the host (the round's one device-to-host copy); with padded trees from
        captured builders (fixed buffers), the packing replays a CUDA graph of its own."""
        if not (self.pad_trees and self.capture_trees):
            return self._pack(trees, None).cpu()
        return self._replayed(("pack", trees.tokens.data_ptr()), lambda: self._pack(trees, None)).cpu()

    @torch.no_grad()
    def generate_autoregressive(self, prompt_ids, max_new_tokens: int = 256,
                                eos_token_id: int | None = None) -> GenerationOutput:
        """Greedy decoding one token per step on the static cache (the AR baseline): the same tokens as the target's
        greedy `generate`. Tokens stay on the device; without `eos_token_id` nothing is read back until the end."""
        prompt = self._prompt(prompt_ids, max_new_tokens, 1)
        stats = DecodeStats(prompt_tokens=prompt.numel())
        model, dev = self.model, self.model.device
        t = time.perf_counter()
        tokens = torch.empty(max(1, max_new_tokens), dtype=torch.long, device=dev)          # [max_new]
        tokens[:1] = model.prefill(prompt).logits.argmax(-1)
        pos = torch.full((1,), prompt.numel(), dtype=torch.long, device=dev)               # [1]
        t = self._tick(stats, "prefill", t)
        n = 1
        while n < max_new_tokens and (eos_token_id is None or int(tokens[n - 1]) != eos_token_id):
            tokens[n:n + 1] = self.runner.decode(tokens[n - 1:n], pos).argmax(-1)
            pos += 1
            n += 1
        new = tokens[:min(n, max_new_tokens)].tolist()
        t = self._tick(stats, "decode", t)
        stats.new_tokens = len(new)
        return GenerationOutput(tokens=new, stats=stats)
