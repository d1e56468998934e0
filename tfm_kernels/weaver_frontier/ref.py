"""The frontier steps of the shape-static Weaver tree build (place, push) in torch ops: the references of the fused
kernels."""
import math

import torch


def place_ref(front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, out, s0: int,
              budget: int, lookahead: int, expand: bool, rows_per_tree: int) -> None:
    """Rank the frontier, place its `width` best entries into slots s0 .. s0+width-1 and keep the next `budget`, in
    place.

    front_int [B, M, 3] long (parent slot, token, depth), front_flt [B, M, 2] f64 (score, log q): the frontier;
    perm [B, M] long, written: its entries by rank (a stable sort by score, descending); slot_int [B, P, 3],
    slot_flt [B, P, 2], slot_placed [B, P] bool: the placement slots; count [B] long: nodes placed so far;
    visible [B, S, S] bool: row s, the slots of the node in slot s's ancestors and itself (rows s0.. written when
    `expand`: the slot's parent's row, the parent, and the slot itself; only itself where the slot does not expand);
    out = (tok, dep [B, W] long, score [B, W] f64, active [B, W] bool, row [B, W] long): the slots' token and depth
    (0 where not active), score, whether the slot is a node at a depth < lookahead (it expands in the next Weaver
    step), and the row of that depth in a candidate table of `rows_per_tree` rows per tree (b * rows_per_tree + dep).
    """
    tok, dep, score, active, row = out
    B, W = tok.shape
    N, S = budget, visible.shape[-1]
    perm.copy_(torch.sort(front_flt[:, :, 0], dim=1, descending=True, stable=True).indices)   # [B, M]
    take = perm[:, :W]                                                        # [B, W]
    ints = front_int.gather(1, take[..., None].expand(B, W, 3))               # [B, W, 3]
    flts = front_flt.gather(1, take[..., None].expand(B, W, 2))               # [B, W, 2]
    slots = torch.arange(W, device=tok.device)
    placed = (flts[..., 0] > -math.inf) & (slots < (N + 1 - count)[:, None])  # [B, W]
    slot_int[:, s0: s0 + W] = ints
    slot_flt[:, s0: s0 + W] = flts
    slot_placed[:, s0: s0 + W] = placed
    count += placed.sum(1)
    keep = perm[:, W: W + N]                                                  # [B, N]
    front_int[:, :N] = front_int.gather(1, keep[..., None].expand(B, N, 3))
    front_flt[:, :N] = front_flt.gather(1, keep[..., None].expand(B, N, 2))
    act = placed & (ints[..., 2] < lookahead)                                 # [B, W]
    if expand:
        par = ints[..., 0].clamp(min=0)                                       # [B, W]
        rows = visible.gather(1, par[..., None].expand(B, W, S))              # [B, W, S]
        cols = torch.arange(S, device=tok.device)
        rows |= cols == par[..., None]
        visible[:, s0: s0 + W] = (rows & act[..., None]) | (cols == (s0 + slots)[:, None])
    tok.copy_(torch.where(act, ints[..., 1], 0))
    dep.copy_(torch.where(act, ints[..., 2], 0))
    score.copy_(flts[..., 0])
    active.copy_(act)
    row.copy_(torch.arange(B, device=tok.device)[:, None] * rows_per_tree + dep)


def push_ref(front_int, front_flt, logq, cand_ids, rows, dep, active, score, s0: int, budget: int,
             expand: int) -> None:
    """Write the children of one Weaver step's W slots into frontier rows budget .. budget+W*E-1 (E = expand), in
    place, and mark the rows after them invalid (score -inf).

    logq [B, W, K] (fp32 or f64): each slot's log q over its K candidates; cand_ids [R, K] long: the candidate
    table, rows [B, W] long: each slot's row of it; dep [B, W] long, active [B, W] bool, score [B, W] f64: the slots'
    depth, whether they expand, their score. Slot w's children are its E first candidates in a stable descending
    sort of log q (equal values in candidate order; NaN first, as torch sorts it). Child j of slot w: parent slot
    s0 + w, token cand_ids[rows[w], c], depth dep + 1, log q in f64, score score[w] + log q, or -inf where the slot
    does not expand or the log q is -inf or NaN.
    """
    B, W, K = logq.shape
    N, E = budget, expand
    order = torch.sort(logq, dim=-1, descending=True, stable=True).indices[..., :E]   # [B, W, E]
    lq = logq.gather(-1, order).to(torch.float64)                             # [B, W, E]
    tokens = cand_ids[rows].gather(-1, order)                                 # [B, W, E]
    valid = active[..., None] & (lq > -math.inf)                              # [B, W, E] (NaN: invalid)
    n = W * E
    ints = front_int[:, N: N + n].view(B, W, E, 3)                            # [B, W, E, 3]
    ints[..., 0] = (s0 + torch.arange(W, device=dep.device))[:, None]         # parent slot
    ints[..., 1] = tokens                                                     # token
    ints[..., 2] = (dep + 1)[..., None]                                       # depth
    flts = front_flt[:, N: N + n].view(B, W, E, 2)                            # [B, W, E, 2]
    flts[..., 0] = torch.where(valid, score[..., None] + lq, -math.inf)
    flts[..., 1] = lq
    front_flt[:, N + n:, 0] = -math.inf


def finish_ref(slot_int, slot_flt, slot_placed, front_flt, last_active, out, budget: int) -> None:
    """The build's trees from its placement slots, in place: node rows and whether each tree is `truncated`.

    slot_int [B, P, 3] long (parent slot, token, depth), slot_flt [B, P, 2] f64 (score, log q), slot_placed [B, P]
    bool: the placement slots (nodes are the placed slots in slot order); front_flt [B, M, 2] f64: the frontier;
    last_active [B, W] bool or None: the last round's slots that would expand (None after an earlier round, whose
    step pushed their children into frontier rows budget..); out = (tokens, parents, depths [B, N+2] long,
    draft_logprobs [B, N+2] f64, num_nodes [B] long, truncated [B] bool), N = budget: columns 0..N the trees
    (parents as node ids, -1 at the root; columns past num_nodes 0, -1, 0, 0.0), column N+1 scratch. A tree is
    `truncated` when it has fewer than N+1 nodes and frontier entries (or last-round slots that would expand) are
    left."""
    tokens, parents, depths, logprobs, num_nodes, truncated = out
    N = budget
    node = slot_placed.cumsum(1) - 1                                          # [B, P] node id of a placed slot
    dst = torch.where(slot_placed, node, N + 1)                               # [B, P]: unplaced -> column N+1
    parent_slot = slot_int[:, :, 0]                                           # [B, P]
    parent = torch.where(parent_slot >= 0, node.gather(1, parent_slot.clamp(min=0)), -1)   # [B, P]
    tokens.zero_().scatter_(1, dst, slot_int[:, :, 1])
    parents.fill_(-1).scatter_(1, dst, parent)
    depths.zero_().scatter_(1, dst, slot_int[:, :, 2])
    logprobs.zero_().scatter_(1, dst, slot_flt[:, :, 1])
    num_nodes.copy_(slot_placed.sum(1))
    if last_active is None:                       # rows N.. hold the last step's children, not yet ranked
        left = (front_flt[:, :, 0] > -math.inf).any(1)                        # [B]
    else:                                         # rows N.. were ranked in the last round: only the kept rows count
        left = (front_flt[:, :N, 0] > -math.inf).any(1) | last_active.any(1)  # [B]
    torch.logical_and(num_nodes < N + 1, left, out=truncated)
