"""CUDA graphs of a compact target's decode, tree verify and (hybrid targets) GDN state commit at fixed tree sizes.

A tree of n nodes runs in the graph of the smallest captured size N >= n: it is padded with N - n nodes that
attend to the committed prefix and themselves only (GDN: roots of their own, from the committed state), so the real
nodes' outputs are unchanged; the padding's K/V land in slots after the tree, which the commit never keeps. Inputs
are copied into static buffers held on the object and the outputs are the graph's static tensors, valid until the
next call. Without CUDA, or for a tree larger than every captured size, the calls run eagerly.

Hybrid (GDN) targets: the verify graph of size N also leaves its GDN stash (what the commit reads) in static tensors,
and a second graph per size writes the GDN states after a leaf held in a static buffer into the pools; the K/V
compaction of the commit (a gather and a scatter of the accepted path's length) runs eagerly. `commit_ops` gives
both halves as ops for a caller's own graph (FastDecoder captures the whole commit stage in one).
"""
from __future__ import annotations

import torch

from tfm_runtime.fast.dense import DenseModel, DenseOutput


def pad_tree(tokens: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor, N: int):
    """tokens, depths [n], anc [n, n] -> [N], [N], [N, N]: padding nodes (token 0, depth 0) see only themselves."""
    n = tokens.shape[0]
    if n == N:
        return tokens, depths, anc
    pad_anc = torch.eye(N, dtype=torch.bool, device=anc.device)                             # [N, N]
    pad_anc[:n, :n] = anc
    return (torch.cat([tokens, tokens.new_zeros(N - n)]), torch.cat([depths, depths.new_zeros(N - n)]), pad_anc)


def warm_up(fn, runs: int = 2) -> None:
    """Run fn on a side stream (what capture needs first: Triton compiles, cuBLAS workspaces)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def capture(fn, warm=None, runs: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of fn() and fn's outputs (static tensors, rewritten by each replay), after `runs` warm-up runs of
    `warm` (default: fn) on a side stream."""
    warm_up(warm or fn, runs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def feed_graph_inputs(static: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], aliased: bool) -> None:
    """Give a captured graph its inputs: copy each into its static buffer, or, for a graph captured on the caller's
    own tensors (`aliased`), check that these are those tensors (same storage, shape and strides): nothing to copy."""
    for dst, src in zip(static, inputs):
        if dst.dtype != src.dtype or dst.shape != src.shape or dst.device != src.device:
            raise ValueError(f"captured with {dst.dtype} {tuple(dst.shape)} on {dst.device}, got {src.dtype} "
                             f"{tuple(src.shape)} on {src.device}")
        if not aliased:
            dst.copy_(src)
        elif src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
            raise ValueError("this graph was captured on the caller's tensors (alias=True): pass those tensors")


class GraphedTarget:
    """`model.verify_tree`, `model.decode` and `model.commit` of a DenseModel or HybridModel, replayed from CUDA graphs
    captured at `tree_sizes` (and size 1 for decode). Capture runs warm-up passes that write K/V into the last slots
    of the cache and GDN states into the pools, so it must happen before a request (at construction, before
    prefill, which starts from empty GDN states)."""

    def __init__(self, model: DenseModel, tree_sizes=()):
        self.model = model
        self.hybrid = hasattr(model, "commit_states")
        self.enabled = model.device.type == "cuda"
        self.graphs: dict[int, tuple] = {}            # N -> (graph, (tokens, depths, anc, start), DenseOutput)
        self.stashes: dict[int, object] = {}          # N -> the verify graph's GDN stash (hybrid)
        self.commits: dict[int, tuple] = {}           # N -> (graph, leaf [1] long) of the GDN state commit (hybrid)
        self.last: int | None = None                  # size of the last verify replayed (hybrid: whose stash counts)
        if self.enabled:
            for N in sorted({1, *tree_sizes}):
                self._capture(N)

    def _capture(self, N: int) -> None:
        m, dev = self.model, self.model.device
        if N > m.max_seq_len:
            raise ValueError(f"tree size {N} exceeds the static cache of {m.max_seq_len} slots")
        tokens = torch.zeros(N, dtype=torch.long, device=dev)                               # [N]
        depths = torch.zeros(N, dtype=torch.long, device=dev)                               # [N]
        anc = torch.eye(N, dtype=torch.bool, device=dev)                                    # [N, N]
        start = torch.full((1,), m.max_seq_len - N, dtype=torch.long, device=dev)           # [1] writes the tail
        graph, out = capture(lambda: m.verify_tree(tokens, depths, anc, start))
        self.graphs[N] = (graph, (tokens, depths, anc, start), out)
        if self.hybrid:
            self.stashes[N] = m._stash
            graph.replay()                                # the stash holds real values for the commit's warm-up
            leaf = torch.zeros(1, dtype=torch.long, device=dev)                             # [1]

            def commit():
                m._stash = self.stashes[N]
                m.commit_states(leaf)
            self.commits[N] = (capture(commit)[0], leaf)

    def verify_tree(self, tokens, depths, anc, start) -> DenseOutput:
        """As DenseModel.verify_tree (outputs cover the n real nodes); `start` an int or a long tensor [1]."""
        n = tokens.shape[0]
        sizes = [N for N in self.graphs if N >= n]
        self.last = None
        if not sizes:
            return self.model.verify_tree(tokens, depths, anc, start)
        N = min(sizes)
        if isinstance(start, int) and start + N > self.model.max_seq_len:
            raise ValueError(f"a padded tree of {N} nodes after {start} committed tokens does not fit the static "
                             f"cache of {self.model.max_seq_len} slots")
        graph, (s_tokens, s_depths, s_anc, s_start), out = self.graphs[N]
        tokens, depths, anc = pad_tree(tokens, depths, anc, N)
        s_tokens.copy_(tokens), s_depths.copy_(depths), s_anc.copy_(anc)
        s_start.copy_(torch.as_tensor(start).reshape(1))
        graph.replay()
        if self.hybrid:
            self.model._stash, self.last = self.stashes[N], N
        return DenseOutput(out.logits[:n], out.hidden[:n], out.taps[:n])

    def commit(self, start, accepted: torch.Tensor) -> None:
        """As model.commit (accepted [A] long on the device, root first) after this object's verify_tree."""
        if not self.hybrid or self.last is None:          # dense, or the last verify ran eagerly
            return self.model.commit(start, accepted)
        if self.model._stash is None:
            raise RuntimeError("commit needs a verify_tree first (and commits each tree once)")
        DenseModel.commit(self.model, start, accepted)                                      # K/V compaction
        graph, leaf = self.commits[self.last]
        leaf.copy_(accepted[-1:])
        graph.replay()
        self.model._stash, self.last = None, None

    def commit_ops(self, N: int, start: torch.Tensor, accepted: torch.Tensor, leaf: torch.Tensor | None = None) -> None:
        """The commit after a verify of size N as ops that a caller may capture in a CUDA graph of its own
        (FastDecoder's commit graph): the K/V compaction of `accepted` and, for hybrid targets, the GDN states after
        `leaf` (default accepted[-1:]; -1: keep the committed states) from size N's stash (after an eager verify: the
        model's own). start [1], accepted [A], leaf [1] long on the device. After replaying such a graph, call
        `committed`."""
        DenseModel.commit(self.model, start, accepted)
        if self.hybrid:
            if N in self.graphs:
                self.model._stash = self.stashes[N]
            self.model.commit_states(accepted[-1:] if leaf is None else leaf)

    def committed(self) -> None:
        """The bookkeeping of a commit that a caller's graph of `commit_ops` did: the verify's stash is spent."""
        if self.hybrid:
            self.model._stash, self.last = None, None

    def decode(self, token: torch.Tensor, pos) -> torch.Tensor:
        """As model.decode: token [1] at position `pos` -> logits [1, V] (hybrid: its GDN states committed)."""
        logits = self.verify_tree(token, self.model.depth0, self.model.one_node, pos).logits
        if self.hybrid:
            if self.last is None:
                self.model.commit_states(self.model.leaf0)
                return logits
            graph, leaf = self.commits[self.last]
            leaf.zero_()
            graph.replay()
            self.model._stash, self.last = None, None
        return logits
