"""CUDA graphs of DenseModel.decode and verify_tree at fixed tree sizes.

A tree of n nodes runs in the graph of the smallest captured size N >= n: it is padded with N - n nodes that
attend to the committed prefix and themselves only, so the real nodes' outputs are unchanged; the padding's K/V land
in slots after the tree, which the commit never keeps. Inputs are copied into static buffers held on the object and
the outputs are the graph's static tensors, valid until the next call. Without CUDA, or for a tree larger than every
captured size, the calls run eagerly.
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


class GraphedDense:
    """`model.verify_tree` and `model.decode` replayed from CUDA graphs captured at `tree_sizes` (and size 1 for
    decode). Capture runs warm-up passes that write K/V into the last slots of the cache, so it must happen before
    a request fills them (at construction, before prefill)."""

    def __init__(self, model: DenseModel, tree_sizes=()):
        self.model = model
        self.enabled = model.device.type == "cuda"
        self.graphs: dict[int, tuple] = {}            # N -> (graph, (tokens, depths, anc, start), DenseOutput)
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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                m.verify_tree(tokens, depths, anc, start)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m.verify_tree(tokens, depths, anc, start)
        self.graphs[N] = (graph, (tokens, depths, anc, start), out)

    def verify_tree(self, tokens, depths, anc, start) -> DenseOutput:
        """As DenseModel.verify_tree (outputs cover the n real nodes); `start` an int or a long tensor [1]."""
        n = tokens.shape[0]
        sizes = [N for N in self.graphs if N >= n]
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
        return DenseOutput(out.logits[:n], out.hidden[:n], out.taps[:n])

    def decode(self, token: torch.Tensor, pos) -> torch.Tensor:
        """As DenseModel.decode: token [1] at position `pos` -> logits [1, V]."""
        return self.verify_tree(token, self.model.depth0, self.model.one_node, pos).logits
