"""Greedy tree acceptance on the host, node by node: the reference of the kernel in `triton.py`."""
import torch


def greedy_accept_ref(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor, num_nodes: torch.Tensor,
                      amax: int, hold: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy verifier's walk down each row's tree (`tfm_runtime.verify.greedy_path`): from the root (node 0),
    move to the first child (lowest node id) whose token is the target's argmax at the current node, at most
    amax - 1 times.

    Args:
        tokens, parents, best: [B, n] long: each tree's node tokens, parents (nodes after their parents), and the
            target's argmax token at each node; columns >= num_nodes[b] are ignored.
        num_nodes: [B] long, 1 <= num_nodes[b] <= n.
        hold: [B] bool or None: rows that accept nothing.
    Returns:
        [B, amax + 3] long: the accepted node ids root first (padded with 0 to amax), then A (their count), the leaf
        (the last of them) and the bonus (the argmax at the leaf). A held row: A = 0, leaf = -1, its root's token as
        the bonus (the token that still comes next), path all 0.
    """
    B = tokens.shape[0]
    out = torch.zeros(B, amax + 3, dtype=torch.long)
    for b in range(B):
        n = int(num_nodes[b])
        tok, par, bst = tokens[b, :n].tolist(), parents[b, :n].tolist(), best[b, :n].tolist()
        if hold is not None and bool(hold[b]):
            out[b, amax:] = torch.tensor([0, -1, tok[0]])
            continue
        path = [0]
        while len(path) < amax:
            nxt = [i for i in range(1, n) if par[i] == path[-1] and tok[i] == bst[path[-1]]]
            if not nxt:
                break
            path.append(nxt[0])
        out[b, :len(path)] = torch.tensor(path)
        out[b, amax:] = torch.tensor([len(path), path[-1], bst[path[-1]]])
    return out.to(tokens.device)
