"""Float64 references for tree-masked Gated DeltaNet and the tree short conv.

Everything here is plain torch in float64 with explicit loops over nodes, written to be
obviously correct rather than fast. The Triton kernels in this package are tested against
these functions.

Conventions (shared with the kernels):
    parent      [B, N] int, parent[b, i] < i, -1 for a root (reads the committed state)
    num_nodes   [B] int, nodes i >= num_nodes[b] are padding
    q, k        [B, N, H, K];  v [B, N, HV, V];  g, beta [B, N, HV]
    S0          [B, HV, K, V]  (K-first; the committed state of each request)
Value head hv reads q/k head hv // (HV // H). Recurrence per node i with parent p:
    S_i = exp(g_i) (I - beta_i k_i k_i^T) S_p + beta_i k_i v_i^T,   o_i = S_i^T (scale q_i)
"""
import torch

F64 = torch.float64


def ancestor_mask(parent, num_nodes):
    """Inclusive ancestor mask: anc[b, i, j] is True iff j lies on the path root..i.

    Args:
        parent: [B, N] int.  num_nodes: [B] int.
    Returns:
        anc: [B, N, N] bool (rows and columns of padding nodes are False).
    """
    B, N = parent.shape
    anc = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(int(num_nodes[b])):
            p = int(parent[b, i])
            if p >= 0:
                anc[b, i] = anc[b, p]
            anc[b, i, i] = True
    return anc


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    H, HV = q.shape[2], v.shape[2]
    q, k, v, g, beta = (t.to(F64) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # GVA: expand the H q/k heads to the HV value heads
    q = (q * scale).repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    return q, k, v, g, beta


def tree_gdn_recurrent(q, k, v, g, beta, parent, num_nodes, S0, scale=None, use_qk_l2norm=True):
    """Node-by-node recurrence (the definition).

    Returns:
        o      [B, N, HV, V]      outputs (zero for padding)
        S      [B, N, HV, K, V]   state after each node
        vnew   [B, N, HV, V]      corrected values v' = beta (v - (e^g S_p)^T k)
        G      [B, N, HV]         path-summed log decay
    """
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    B, N, HV, V = v.shape
    K = k.shape[-1]
    S0 = S0.to(F64)
    o = torch.zeros(B, N, HV, V, dtype=F64)
    S = torch.zeros(B, N, HV, K, V, dtype=F64)
    vnew = torch.zeros(B, N, HV, V, dtype=F64)
    G = torch.zeros(B, N, HV, dtype=F64)
    for b in range(B):
        for i in range(int(num_nodes[b])):
            p = int(parent[b, i])
            Sp, Gp = (S0[b], 0.0) if p < 0 else (S[b, p], G[b, p])
            Sd = torch.exp(g[b, i])[:, None, None] * Sp
            u = beta[b, i][:, None] * (v[b, i] - torch.einsum('hkv,hk->hv', Sd, k[b, i]))
            S[b, i] = Sd + k[b, i][:, :, None] * u[:, None, :]
            o[b, i] = torch.einsum('hkv,hk->hv', S[b, i], q[b, i])
            vnew[b, i] = u
            G[b, i] = Gp + g[b, i]
    return o, S, vnew, G


def tree_gdn_closed_form(q, k, v, g, beta, parent, num_nodes, S0, scale=None, use_qk_l2norm=True):
    """Closed form with the ancestor-masked unit-lower-triangular solve.

    G = anc @ g;  A = strict(anc) * beta_i e^{G_i-G_j} k_i.k_j;  V' = (I+A)^{-1} beta (V - e^G K S0);
    O = e^G Q S0 + (anc * e^{G_i-G_j} Q K^T) V'.   Returns (o, vnew, G) like tree_gdn_recurrent.
    """
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    B, N, HV, V = v.shape
    S0 = S0.to(F64)
    anc = ancestor_mask(parent, num_nodes)
    o = torch.zeros(B, N, HV, V, dtype=F64)
    vnew = torch.zeros(B, N, HV, V, dtype=F64)
    G = torch.zeros(B, N, HV, dtype=F64)
    for b in range(B):
        n = int(num_nodes[b])
        if n == 0:
            continue
        m = anc[b, :n, :n].to(F64)
        qb, kb, vb = (t[b, :n].transpose(0, 1) for t in (q, k, v))      # [HV, n, .]
        gb, bb = g[b, :n].T, beta[b, :n].T                                # [HV, n]
        Gb = gb @ m.T                                                     # [HV, n]
        # mask before the exp: non-ancestor differences may be positive
        D = torch.where(m.bool(), Gb[:, :, None] - Gb[:, None, :], -torch.inf).exp()  # [HV, n, n]
        A = bb[:, :, None] * D * (kb @ kb.transpose(1, 2)) * (1 - torch.eye(n, dtype=F64))
        R = bb[:, :, None] * (vb - torch.exp(Gb)[:, :, None] * (kb @ S0[b]))
        I = torch.eye(n, dtype=F64).expand(HV, n, n)
        U = torch.linalg.solve_triangular(I + A, R, upper=False, unitriangular=True)
        O = torch.exp(Gb)[:, :, None] * (qb @ S0[b]) + (D * (qb @ kb.transpose(1, 2))) @ U
        o[b, :n], vnew[b, :n], G[b, :n] = O.transpose(0, 1), U.transpose(0, 1), Gb.T
    return o, vnew, G


def tree_gdn_commit(S0, leaf, parent, k, vnew, G, use_qk_l2norm=True):
    """State after accepting the path root..leaf, from the verify by-products.

    S_new = e^{G_leaf} S0 + sum_{j in path} e^{G_leaf - G_j} k_j v'_j^T.
    Args: S0 [B, HV, K, V]; leaf [B] (-1: nothing accepted, S_new = S0); parent [B, N];
          k [B, N, H, K]; vnew [B, N, HV, V]; G [B, N, HV].
    Returns: [B, HV, K, V] float64.
    """
    HV, H = vnew.shape[2], k.shape[2]
    k = k.to(F64)
    if use_qk_l2norm:
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    k = k.repeat_interleave(HV // H, dim=2)
    vnew, G = vnew.to(F64), G.to(F64)
    out = S0.to(F64).clone()
    for b in range(S0.shape[0]):
        a = int(leaf[b])
        if a < 0:
            continue
        out[b] = torch.exp(G[b, a])[:, None, None] * out[b]
        j = a
        while j >= 0:
            w = torch.exp(G[b, a] - G[b, j])[:, None, None]
            out[b] += w * k[b, j][:, :, None] * vnew[b, j][:, None, :]
            j = int(parent[b, j])
    return out


def _window(x_b, state_b, parent_b, i, width):
    """The last `width` inputs on the path to node i, oldest first: [width, D].

    The sequence is the committed conv state (oldest first) followed by the path root..i;
    node -1 means "newest committed entry", -2 the one before it, and so on.
    """
    S = state_b.shape[-1]
    rows, cur = [], i
    for _ in range(width):
        if cur >= 0:
            rows.append(x_b[cur])
            cur = int(parent_b[cur])
            if cur < 0:
                cur = -1
        else:
            rows.append(state_b[:, S + cur] if S + cur >= 0 else torch.zeros_like(x_b[0]))
            cur -= 1
    return torch.stack(rows[::-1])


def tree_conv1d(x, conv_state, weight, bias, parent, num_nodes, activation="silu"):
    """Depthwise causal conv along each node's ancestor path.

    Args:
        x [B, N, D]; conv_state [B, D, S] (S >= W-1, oldest first); weight [D, W]; bias [D] or None.
    Returns: [B, N, D] float64 (zero for padding nodes).
    """
    B, N, D = x.shape
    W = weight.shape[1]
    x, conv_state, weight = x.to(F64), conv_state.to(F64), weight.to(F64)
    out = torch.zeros(B, N, D, dtype=F64)
    for b in range(B):
        for i in range(int(num_nodes[b])):
            y = (_window(x[b], conv_state[b], parent[b], i, W).T * weight).sum(-1)
            if bias is not None:
                y = y + bias.to(F64)
            out[b, i] = y * torch.sigmoid(y) if activation == "silu" else y
    return out


def tree_conv1d_commit(x, conv_state, leaf, parent):
    """Committed conv state after accepting root..leaf: the last S inputs of that sequence.

    Args: x [B, N, D]; conv_state [B, D, S]; leaf [B] (-1: unchanged); parent [B, N].
    Returns: [B, D, S] float64.
    """
    S = conv_state.shape[-1]
    x, conv_state = x.to(F64), conv_state.to(F64)
    return torch.stack([_window(x[b], conv_state[b], parent[b], int(leaf[b]), S).T
                        for b in range(x.shape[0])])


def make_tree(n, kind="random", p_chain=0.5, topk=4, generator=None):
    """A topological parent array [n] (parent[0] = -1) of a given shape, for tests and benchmarks.

    kind: "chain"; "star" (all children of the root); "binary" (complete binary tree);
    "eagle" (level by level, the first `topk` nodes of a level get `topk` children each);
    "random" (parent i-1 with probability p_chain, else uniform over earlier nodes);
    "spine" (extends the deepest path with probability p_chain, else a uniform earlier node:
    depth ~ p_chain * n with branches interleaved along it).
    """
    parent = torch.full((n,), -1, dtype=torch.int64)
    if kind == "chain":
        parent[1:] = torch.arange(n - 1)
    elif kind == "star":
        parent[1:] = 0
    elif kind == "binary":
        parent[1:] = (torch.arange(1, n) - 1) // 2
    elif kind == "eagle":
        level, i = [0], 1
        while i < n:
            nxt = []
            for p in level[:topk]:
                for _ in range(topk):
                    if i < n:
                        parent[i] = p
                        nxt.append(i)
                        i += 1
            level = nxt
    elif kind == "random":
        for i in range(1, n):
            chain = torch.rand(1, generator=generator).item() < p_chain
            parent[i] = i - 1 if chain else torch.randint(0, i, (1,), generator=generator).item()
    elif kind == "spine":
        tip = 0
        for i in range(1, n):
            if torch.rand(1, generator=generator).item() < p_chain:
                parent[i], tip = tip, i
            else:
                parent[i] = torch.randint(0, i, (1,), generator=generator).item()
    else:
        raise ValueError(f"unknown tree kind {kind!r}")
    return parent


def tree_depth(parent):
    """Number of nodes on the longest root..leaf path of a parent array [n]."""
    depth = []
    for i, p in enumerate(parent.tolist()):
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)
