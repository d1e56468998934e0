"""FastDecoder: SpeculativeDecoder's loop on a compact target (DenseModel; HybridModel for GDN hybrids), static caches.

  prefill the prompt (static cache) -> bonus token, DFlash context (StaticDFlash: static context cache)
  repeat:  DFlash drafts L marginals from the bonus  ->  proposal tree (chain | ddtree | weaver)
           (shape-static builders on the device, no host reads until after the verify; sampled chains: reference)
           DenseModel.verify_tree: one pass writing the nodes' K/V after the committed prefix
           lossless verification (the reference rules) -> accepted path + bonus    (the one host sync; at T = 0
           only the nodes' argmax ids travel, and the path is read off them: the host `Tree` is built and
           checked in the next round, while the device drafts, builds and verifies)
           commit (`_commit_ops`; with CUDA graphs one replay per round): the accepted nodes' K/V move into place
           (hybrid: the GDN states after the leaf), DFlash extends its context with their taps, the next round's
           bonus, committed length and h_last stay on the device (the path and bonus: one host-to-device copy)

Drafting, sampled chains, verification rules, sampling order and statistics are the reference decoder's own
(tfm_runtime.engine); greedy chains, DDTrees and Weaver trees come from StaticChainBuilder, StaticDDTreeBuilder and
StaticWeaverTreeBuilder, which build the reference's trees. So for the same inputs and generator both decoders emit
the same tokens.
"""
from __future__ import annotations

import time

import torch

from tfm_runtime.engine import DecodeStats, GenerationOutput, SpeculativeDecoder, check_decoder_arguments, finish
from tfm_runtime.fast.ddtree import StaticChainBuilder, StaticDDTreeBuilder
from tfm_runtime.fast.dense import DenseModel
from tfm_runtime.fast.dflash import StaticDFlash
from tfm_runtime.fast.graphs import GraphedTarget, capture
from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, ancestor_masks
from tfm_runtime.models.dflash import DFlashDrafter
from tfm_runtime.models.weaver import Weaver
from tfm_runtime.sampling import filter_probs
from tfm_runtime.tree import Tree
from tfm_runtime.verify import greedy_path, verify_greedy_best


class FastDecoder:
    """Speculative decoding of one request at a time, with SpeculativeDecoder's arguments and `generate` API.

    `target`: a TargetModel or a Hugging Face causal LM: Llama or Qwen3 dense (a `DenseModel`), or a Qwen3-Next /
    Qwen3.5 hybrid with GDN layers (a `HybridModel`). Its weights are shared with that model, whose KV cache holds
    `max_seq_len` slots (default: the model's max_position_embeddings, at most 4096); a request needs prompt +
    max_new_tokens + tree_budget slots. `gdn_backend`: the hybrid model's GDN backend (see HybridModel).
    `attention`: see DenseModel.
    `cuda_graphs`: on CUDA, replay tree verify (every tree padded to the largest tree size), decode, the DFlash
    draft and the whole commit stage (one graph per accepted path length) from CUDA graphs captured here
    (tfm_runtime.fast.graphs, StaticDFlash, `_capture_commits`), and the tree build from a graph captured at its
    first build; ignored on the CPU.
    Greedy chains and DDTrees: one StaticChainBuilder / StaticDDTreeBuilder built here. Weaver trees: one
    StaticWeaverTreeBuilder (batch 1) built here, `weaver_rounds` its round count (default: the worst case, so every
    tree is the reference's, in two phases of which the second runs only for trees that need it; fewer rounds may
    cut trees short, see tfm_runtime.fast.weaver_tree).
    `profile`: time each stage (prefill, draft, tree, verify, commit in `stats.seconds`) with a device sync after
    each; off, a step's only host sync is the one read of the verified tree (T = 0: its nodes and the target's
    argmax per node, one copy) and the loop's time is recorded as `step`.
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
        """Close the open profiler range of `generate` (if any) and open "tfm.<stage>" (none for None)."""
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
        # the round's device-side state: the accepted path and the bonus (one host-to-device copy per round),
        # the committed length, the last accepted node's hidden state
        L1, dev = drafter.lookahead + 1, self.model.device
        self.step_host = torch.zeros(L1 + 1, dtype=torch.long)                  # [path node ids ..., bonus]
        if dev.type == "cuda":
            self.step_host = self.step_host.pin_memory()
        self.step_dev = torch.zeros(L1 + 1, dtype=torch.long, device=dev)       # [L + 2]
        self.start_dev = torch.zeros(1, dtype=torch.long, device=dev)           # [1]
        self.h_last = torch.zeros(self.model.embed.shape[-1], dtype=self.model.dtype, device=dev)  # [H]
        self.commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}     # accepted length -> the commit stage's graph
        if self.pad_trees and self.dflash.graphs:
            self._capture_commits()

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
        model, runner, dev = self.model, self.runner, self.model.device
        if self.profile:
            self._stage_range("prefill")
        t = time.perf_counter()
        out = model.prefill(prompt)
        self.dflash.prefill(out.taps)
        first = filter_probs(out.logits.double(), temperature, top_k, top_p)[0]
        bonus = int(first.argmax()) if temperature == 0 else int(torch.multinomial(first.cpu(), 1, generator=generator))
        start, new = prompt.numel(), [bonus]
        # each round reads its bonus, committed length and h_last from fixed device buffers (then the commit's)
        self.start_dev.fill_(start)
        self.step_dev[-1:].fill_(bonus)
        self.dflash.block[:1].fill_(bonus)
        self.h_last.copy_(out.hidden[-1])
        root, h_last = self.step_dev[-1:], self.h_last                                  # [1], [H]
        t = self._tick(stats, "prefill", t)
        # chains sampled from DFlash (chain_sampling) come from the reference builder, with its random draws
        static = self.weaver_builder or self.ddtree_builder or (self.chain_builder if rule != "chain_sampling"
                                                                else None)
        unchecked = None                # T = 0, static builders: the last round's packed tree, checked a round late
        while len(new) < max_new_tokens and bonus != eos_token_id:
            if self.profile:
                self._stage_range("draft")
            draft_logits, draft_hidden = self.dflash.draft(None)                   # [L, V], [L, H] after `root`
            t = self._tick(stats, "draft", t)
            if static is None:
                tree, draft_probs = self._tree(bonus, draft_logits, draft_hidden, h_last, temperature, generator)
                nodes = (tree.tokens.to(dev), tree.depths.to(dev), tree.ancestor_mask().to(dev))
            else:
                tree, draft_probs = None, None
                trees, nodes = self._static_tree(static, root, draft_logits, draft_hidden, h_last)
            t = self._tick(stats, "tree", t)
            out = runner.verify_tree(*nodes, self.start_dev)
            if unchecked is not None:                         # while the device drafts, builds and verifies
                self._unpack(unchecked)
                unchecked = None
            packed = None
            if tree is None:                                  # the tree on the host, for the verify rules
                greedy = rule == "greedy"                     # the argmax travels with the tree
                packed = self._read_packed(trees, out.logits if greedy else None)
                if self._truncated(packed) and self._deferred(static):   # rare: the Weaver tree needs its 2nd phase
                    trees = static.finish()
                    out = runner.verify_tree(*self._nodes(trees), self.start_dev)
                    packed = self._read_packed(trees, out.logits if greedy else None)
                if not greedy:
                    tree, _, _ = self._unpack(packed)
            t = self._tick(stats, "verify", t)
            if rule == "greedy":
                if tree is None:                              # the Tree is built (and checked) after the commit
                    accepted, bonus = self._greedy_path(packed)
                else:
                    accepted, bonus = verify_greedy_best(tree, out.logits[:tree.num_nodes].argmax(-1).cpu())
            else:
                accepted, bonus = self._verify(rule, tree, out.logits[:tree.num_nodes].cpu(), draft_probs,
                                               temperature, top_k, top_p, generator)
            A = len(accepted)
            self.step_host[:A] = torch.as_tensor(accepted)
            self.step_host[-1] = int(bonus)
            self.step_dev.copy_(self.step_host, non_blocking=True)   # pinned on CUDA; rewritten after the next sync
            if self.commit_graphs:
                if out.hidden.data_ptr() != self._padded_out().hidden.data_ptr():
                    raise RuntimeError("internal: the tree was not verified in the graph of the padded size")
                self.commit_graphs[A].replay()
            else:
                self._commit_ops(out, A)
            if isinstance(runner, GraphedTarget):
                runner.committed()
            start += A
            if tree is None:                                  # the Tree is built and checked next round
                unchecked = packed
                new += self._tokens(packed, accepted[1:]) + [int(bonus)]
                stats.tree_sizes.append(self._node_count(packed))
            else:
                new += tree.tokens[accepted[1:]].tolist() + [int(bonus)]
                stats.tree_sizes.append(tree.num_nodes)
            stats.accept_lengths.append(len(accepted))
            t = self._tick(stats, "commit", t)
        if unchecked is not None:
            self._unpack(unchecked)
        return finish(new, stats, max_new_tokens, eos_token_id)

    def _capture_commits(self) -> None:
        """CUDA graphs of the commit stage (`_commit_ops`), one per accepted path length A = 1 .. min(L + 1,
        max_nodes), reading the outputs of the verify graph at max_nodes (every tree goes in padded to it): one
        replay where the eager stage takes about fifteen launches. Captured before any request: the warm-up runs
        write slots at the end of the target's cache, DFlash context slots and GDN states, all of which the next
        prefill resets."""
        m, d, N = self.model, self.dflash, self.max_nodes
        out, tail = self._padded_out(), m.max_seq_len - N
        length = d.length.clone()
        for A in range(1, min(self.drafter.lookahead + 1, N) + 1):
            self.step_dev[:A].copy_(torch.arange(A, device=m.device))

            def warm(A=A):
                self.start_dev.fill_(tail)
                d.length.zero_()
                self._commit_ops(out, A)
            self.commit_graphs[A] = capture(lambda A=A: self._commit_ops(out, A), warm=warm)[0]
        d.length.copy_(length)
        self.runner.committed()

    def _commit_ops(self, out, A: int) -> None:
        """The commit stage of a path of A nodes, as device ops with no host values but A: the target keeps the path
        `step_dev[:A]` of the tree verified after `start_dev` committed tokens (its K/V; hybrid: the GDN states
        after its leaf), DFlash extends its context by the path's taps, the leaf's hidden state becomes `h_last`,
        `start_dev` grows by A and the bonus `step_dev[-1]` goes into DFlash's block for the next draft.
        out: the verify's DenseOutput (hidden [n, H], taps [n, F])."""
        acc, d = self.step_dev[:A], self.dflash                                         # [A] the path's node ids
        if isinstance(self.runner, GraphedTarget):
            self.runner.commit_ops(self.max_nodes, self.start_dev, acc)
        else:
            self.model.commit(self.start_dev, acc)
        d.taps_in[:A].copy_(out.taps.index_select(0, acc))                              # [A, F]
        d.count.fill_(A)
        d._extend()
        self.h_last.copy_(out.hidden.index_select(0, acc[A - 1:])[0])                   # [H] the leaf's
        self.start_dev.add_(A)
        d.block[:1].copy_(self.step_dev[-1:])                                           # the next round's bonus

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
        """Whether builder b's second phase waits for the verify's host read (`truncated` read with the tree): a
        Weaver build with two phases whose trees go to the verify padded, i.e. with no host read before it."""
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

    @staticmethod
    def _pack(trees, logits: torch.Tensor | None) -> torch.Tensor:
        """Row 0 of `trees` and, given the verify's logits [n, V] (n <= N+1 rows, node order), the target's argmax
        per node, as one long tensor [5 or 6, N+1] on the device: tokens, parents, depths, log q (its float64 bits),
        (num_nodes, truncated), argmax."""
        count = torch.stack([trees.num_nodes[0], trees.truncated[0].long()])           # [2]
        rows = [trees.tokens[0], trees.parents[0], trees.depths[0], trees.draft_logprobs[0].view(torch.long),
                torch.nn.functional.pad(count, (0, trees.tokens.shape[1] - 2))]         # 5 x [N+1]
        if logits is not None:
            best = logits.argmax(-1)                                                   # [n]
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

    @staticmethod
    def _node_count(host: torch.Tensor) -> int:
        """`_pack`'s tensor, on the host -> the tree's node count."""
        return int(host[4, 0])

    @staticmethod
    def _tokens(host: torch.Tensor, ids: list[int]) -> list[int]:
        """`_pack`'s tensor, on the host -> the tokens of nodes `ids`."""
        return host[0, ids].tolist()

    @staticmethod
    def _greedy_path(host: torch.Tensor) -> tuple[list[int], int]:
        """`_pack`'s tensor with the argmax row, on the host -> the greedy verifier's accepted node ids and bonus,
        read off the ids without building the `Tree`."""
        n = FastDecoder._node_count(host)
        return greedy_path(host[0, :n].tolist(), host[1, :n].tolist(), host[5, :n].tolist())

    def _read_packed(self, trees, logits: torch.Tensor | None) -> torch.Tensor:
        """`_pack`'s tensor on the host (the step's one device-to-host copy); with padded trees from captured
        builders and the verify graph's logits (fixed buffers), the packing replays a CUDA graph of its own (eagerly
        it takes about seven launches)."""
        fixed = self.pad_trees and self.capture_trees and (
            logits is None or logits.data_ptr() == self._padded_out().logits.data_ptr())
        if not fixed:
            return self._pack(trees, logits).cpu()
        key = ("pack", trees.tokens.data_ptr(), 0 if logits is None else logits.data_ptr())
        return self._replayed(key, lambda: self._pack(trees, logits)).cpu()                 # [5 or 6, N+1]

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
