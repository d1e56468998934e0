"""GDN tree verify/commit on a GPU: inputs and the correctness checks of `bench_gdn_tree.py`.

Shape: Qwen3.6-27B GDN layer (H=16, HV=48, K=V=128). Every check compares against the float64
node-by-node recurrence (`tfm_kernels.gdn_tree.ref`): o, the stashed V', G and the committed states of
three leaves (deepest, last, root) written into fresh slots; the source slot and the pool must be
unchanged by verify. o is stored in the input dtype (bf16 rounding alone gives ~1.7e-3 rel-RMS).
"""
import dataclasses
import json
import time

import torch

from tfm_kernels.gdn_tree import GDNTuning, ref, tree_gdn_commit, tree_gdn_verify

H, HV, K, V = 16, 48, 128, 128


def rel(x, r):
    """Relative RMS error of x against the reference r (both moved to float64 on the host)."""
    r = r.double().cpu()
    return ((x.double().cpu() - r).norm() / r.norm().clamp_min(1e-30)).item()


def make_inputs(B, N, n, kind, dtype, state_dtype=torch.float32, v_first=False, seed=0,
                gnorm=1.0, P=None, dev="cuda", p_chain=0.6, HV=HV):
    """Random trees and GDN inputs. Returns (cpu dict with S0 [B, HV, K, V], device dict with pool)."""
    gen = torch.Generator().manual_seed(seed)
    parent = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        parent[b, :n[b]] = ref.make_tree(n[b], kind, p_chain=p_chain, generator=gen).int()
    num = torch.tensor(n, dtype=torch.int32)
    q, k = (torch.randn(B, N, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, N, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, N, HV, generator=gen)) / gnorm
    beta = torch.rand(B, N, HV, generator=gen)
    P = P or 2 * B
    pool = torch.randn(P, HV, K, V, generator=gen) * 0.5
    sidx = torch.randperm(P, generator=gen)[:B].int()
    cpu = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, parent=parent,
               num=num, S0=pool.to(state_dtype)[sidx.long()].float(), sidx=sidx)
    pool_d = pool.to(state_dtype)
    if v_first:
        pool_d = pool_d.transpose(-1, -2).contiguous()
    gpu = {key: val.to(dev) for key, val in cpu.items() if key != "S0"}
    gpu["pool"] = pool_d.to(dev)
    return cpu, gpu


def leaves(parent, n):
    """Deepest, last and root node of a tree (the commits that are checked)."""
    dep = [0] * n
    for i in range(n):
        dep[i] = 0 if parent[i] < 0 else dep[parent[i]] + 1
    return {"deep": max(range(n), key=dep.__getitem__), "last": n - 1, "root": 0}


def check_case(case, warm=False):
    """Verify + commit of one configuration against the float64 recurrence (warm: run only)."""
    B, N, n, kind, dtype, prec = (case[x] for x in ("B", "N", "n", "kind", "dtype", "prec"))
    sd, vf = case.get("state_dtype", torch.float32), case.get("v_first", False)
    cpu, d = make_inputs(B, N, n, kind, dtype, sd, vf, seed=case.get("seed", 0),
                         gnorm=case.get("gnorm", 1.0), p_chain=case.get("p_chain", 0.6))
    before = d["pool"].clone()
    tuning = GDNTuning.for_shape(N, d["v"].device)
    if case.get("block_t"):
        tuning = dataclasses.replace(tuning, block_t=case["block_t"])
    o, st = tree_gdn_verify(d["q"], d["k"], d["v"], d["g"], d["beta"], d["parent"], d["num"],
                            d["pool"], d["sidx"], state_v_first=vf, precision=prec, tuning=tuning)
    torch.cuda.synchronize()
    if warm:
        tree_gdn_commit(d["pool"], d["sidx"], d["num"] - 1, st, precision=prec)
        return dict(name=case["name"], warm=True)
    unchanged = bool(torch.equal(before, d["pool"]))
    ro, S, rv, rG = ref.tree_gdn_recurrent(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"],
                                           cpu["parent"], cpu["num"], cpu["S0"])
    res = dict(name=case["name"], B=B, N=N, n=n, kind=kind, dtype=str(dtype), precision=prec,
               state_dtype=str(sd), v_first=vf, block_t=case.get("block_t"),
               pool_unchanged=unchanged,
               depth=[ref.tree_depth(cpu["parent"][b, :n[b]]) for b in range(B)],
               o=rel(o, ro), vnew=rel(st.vnew, rv), G=rel(st.G, rG), nan=bool(o.isnan().any()))
    worst = 0.0
    for pick in ("deep", "last", "root"):
        leaf = [leaves(cpu["parent"][b, :n[b]].tolist(), n[b])[pick] for b in range(B)]
        free = [s for s in range(d["pool"].shape[0]) if s not in cpu["sidx"].tolist()]
        out_idx = torch.tensor(free[:B], dtype=torch.int32, device="cuda")
        src_before = d["pool"][d["sidx"].long()].clone()
        tree_gdn_commit(d["pool"], d["sidx"], torch.tensor(leaf, device="cuda"), st,
                        out_idx=out_idx, precision=prec)
        got = d["pool"][out_idx.long()].float().cpu()
        if vf:
            got = got.transpose(-1, -2)
        for b in range(B):
            worst = max(worst, rel(got[b], S[b, leaf[b]]))
        unchanged &= bool(torch.equal(src_before, d["pool"][d["sidx"].long()]))
        d["pool"].copy_(before)
    res.update(commit=worst, source_unchanged=unchanged)
    tol = 1e-5 if (dtype == torch.float32 and prec == "ieee") else \
        2e-3 if dtype == torch.float32 else 3e-3
    ctol = tol if sd == torch.float32 else 4e-3
    res["pass"] = bool(res["o"] < tol and res["vnew"] < tol and res["commit"] < ctol and unchanged
                       and not res["nan"])
    return res


def correctness_cases():
    """The real-shape matrix: every solve block size, layouts, state dtype, varlen, deep trees."""
    f32, bf16 = torch.float32, torch.bfloat16
    c = [dict(name=f"bf16-tf32-{kind}-{n}-bt{bt}", B=1, N=n, n=[n], kind=kind, dtype=bf16,
              prec="tf32", block_t=bt)
         for n, kind in ((65, "eagle"), (129, "spine")) for bt in (16, 32, 64)]
    c += [
        dict(name="bf16-tf32-chain-16", B=1, N=16, n=[16], kind="chain", dtype=bf16, prec="tf32"),
        dict(name="f32-ieee-spine-129", B=1, N=129, n=[129], kind="spine", dtype=f32, prec="ieee"),
        dict(name="bf16-tf32-varlen-B3", B=3, N=70, n=[70, 33, 1], kind="spine", dtype=bf16,
             prec="tf32"),
        dict(name="bf16-tf32-vfirst-65", B=2, N=65, n=[65, 40], kind="eagle", dtype=bf16,
             prec="tf32", v_first=True),
        dict(name="bf16-tf32-bf16state-65", B=1, N=65, n=[65], kind="spine", dtype=bf16,
             prec="tf32", state_dtype=bf16),
        dict(name="bf16-tf32-strongdecay-65", B=1, N=65, n=[65], kind="spine", dtype=bf16,
             prec="tf32", gnorm=0.01),
        dict(name="bf16-tf32-deep-256", B=1, N=256, n=[256], kind="spine", dtype=bf16,
             prec="tf32", p_chain=0.8),
    ]
    return c


def _checked(args):
    """`check_case` that records an exception instead of raising (one broken case must not hide the
    others), skipping cases not started before t_end; runs in a worker process when jobs > 1."""
    c, warm, t_end, threads = args
    if threads:
        torch.set_num_threads(threads)
    if time.time() > t_end:
        return dict(name=c["name"], skipped="out of time")
    try:
        r = check_case(c, warm)
    except Exception as e:  # noqa: BLE001
        r = dict(name=c["name"], error=repr(e)[:400], **{"pass": False})
    if not warm:
        print(json.dumps(r), flush=True)
    return r


def correctness_matrix(warm=False, t_end=float("inf"), jobs=1):
    """Run `correctness_cases` (cases not started before `t_end` are recorded as skipped).

    jobs > 1: that many worker processes (spawned, each with its own CUDA context and a share of the
    CPU threads), since each case's cost is its Triton compiles and the float64 host recurrence.
    """
    cases = correctness_cases()
    if jobs <= 1:
        return [_checked((c, warm, t_end, 0)) for c in cases]
    import multiprocessing as mp
    threads = max(1, (torch.get_num_threads() or 1) // jobs)
    with mp.get_context("spawn").Pool(jobs) as pool:
        return pool.map(_checked, [(c, warm, t_end, threads) for c in cases], chunksize=1)


def fla_chain_check(results, ns=(16, 65, 129)):
    """fla chunk_gated_delta_rule on chains against ours and the float64 recurrence."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    for n in ns:
        cpu, d = make_inputs(1, n, [n], "chain", torch.bfloat16)
        S0 = d["pool"][d["sidx"].long()].contiguous()
        o_f, h_f = chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                          initial_state=S0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        o, st = tree_gdn_verify(d["q"], d["k"], d["v"], d["g"], d["beta"], d["parent"], d["num"],
                                d["pool"], d["sidx"])
        tree_gdn_commit(d["pool"], d["sidx"], torch.tensor([n - 1], device="cuda"), st)
        ro, S, _, _ = ref.tree_gdn_recurrent(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"],
                                             cpu["parent"], cpu["num"], cpu["S0"])
        r = dict(name=f"fla-chain-{n}", o_ours=rel(o, ro), o_fla=rel(o_f, ro),
                 o_ours_vs_fla=rel(o, o_f), state_ours=rel(d["pool"][d["sidx"].long()][0], S[0, n - 1]),
                 state_fla=rel(h_f[0], S[0, n - 1]))
        print(json.dumps(r), flush=True)
        results.append(r)
