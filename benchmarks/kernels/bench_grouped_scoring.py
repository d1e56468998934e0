"""Grouped candidate scoring (training) on a GPU: forward + backward per launch configuration, against the
gather kernels, and where the time goes.

Qwen3.6-27B LM head (vocab 248320, hidden 5120, bf16), `--rows` anchor rows x 15 depths x 512 candidates
replayed from real top-512 sets (`benchmarks/data/smollm2_top512.npz`, as `benchmarks.pipelines.train_bench
--candidates replay`), bias and bf16 hidden as in the Weaver objective. Per rows-per-group: the union size, the memory
floor of both passes (2 x distinct ids x hidden x 2 bytes / 4.8 TB/s), the time of each configuration in
`SWEEP` (median of CUDA-event timed iterations), a kernel-by-kernel profile of the default one, and its
agreement with the gather kernels.

    python -m benchmarks.kernels.bench_grouped_scoring --out out/grouped_scoring.json
"""
import argparse
import dataclasses

import torch

from benchmarks.common import env, fwd_bwd_ms, write_results
from benchmarks.pipelines.train_bench import replay_candidates, union_stats
from tfm_kernels.candidate_logits import candidate_log_probs
from tfm_kernels.candidate_logits.grad import HiddenGradTuning, candidate_hidden_grad
from tfm_kernels.candidate_logits.grouped import GroupedTuning, grouped_candidate_log_probs

V, D, L, K = 248320, 5120, 15, 512
# GroupedTuning fields to change from the default, and "precision" of the union backward's dot: the default, then
# one setting changed at a time
SWEEP = [{}, dict(bwd_bu=16), dict(bwd_bd=256), dict(num_stages=4), dict(bwd_bu=64, bwd_bd=128),
         dict(precision="tf32")]


def profile(fn, q, iters=3):
    """CUDA time per iteration by kernel name (the top 12), in ms."""
    from torch.profiler import ProfilerActivity
    fwd_bwd_ms(fn, q, iters=1, warmup=0)
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd_ms(fn, q, iters=iters, warmup=0)
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    return {e.key[:90]: round(e.device_time_total / iters / 1e3, 3) for e in rows}


# HiddenGradTuning fields of the gather backward (tfm_kernels/candidate_logits/grad.py) to change from the default
# ({} = 8 x 512 tiles, 4 warps, 3 stages)
HIDDEN_GRAD_SWEEP = [{}, dict(block_c=32, block_d=256), dict(block_c=8, block_d=512), dict(block_c=16, block_d=1024),
                     dict(block_c=8, block_d=1024), dict(num_warps=8, block_c=16, block_d=1024), dict(num_stages=4),
                     dict(num_stages=2), dict(num_warps=2), dict(block_c=32, block_d=512)]


def hidden_grad_sweep(weight, cand, iters, sweep=HIDDEN_GRAD_SWEEP):
    """Milliseconds of candidate_hidden_grad alone (CUDA events, median) per HIDDEN_GRAD_SWEEP entry, with the
    largest deviation from the default's output."""
    import statistics

    dl = torch.randn(cand.shape, device=cand.device) * 1e-3
    want = candidate_hidden_grad(dl, weight, cand, 1.0, torch.bfloat16)
    default = HiddenGradTuning.for_shape(cand.shape[1], weight.shape[1])
    out = []
    for changes in sweep:
        tuning = dataclasses.replace(default, **changes)
        ts = []
        for i in range(iters + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            got = candidate_hidden_grad(dl, weight, cand, 1.0, torch.bfloat16, tuning)
            b.record()
            torch.cuda.synchronize()
            if i >= 2:
                ts.append(a.elapsed_time(b))
        out.append(dict(tuning=changes, ms=statistics.median(ts),
                        max_abs_diff=(got.float() - want.float()).abs().max().item()))
        print(f"hidden grad {changes}: {out[-1]['ms']:.2f} ms (max diff {out[-1]['max_abs_diff']:.1e})", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024, help="anchor rows (each 15 depths x 512 candidates)")
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8], help="anchor rows per group")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sweep-from", type=int, default=0, help="with --hidden-grad: HIDDEN_GRAD_SWEEP[i:] only")
    ap.add_argument("--hidden-grad", action="store_true",
                    help="only time the gather backward kernel (candidate_hidden_grad) over HIDDEN_GRAD_SWEEP")
    ap.add_argument("--sweep", type=int, nargs="+", help="only these SWEEP entries (indexes)")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel-by-kernel profiles")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(V, D, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    M = args.rows * L
    cand = replay_candidates(args.rows, L, K, V, seed=1).reshape(M, K).to(dev)
    q = torch.randn(M, D, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()
    bias = torch.randn(M, K, generator=g, device=dev)
    res = dict(env=env(), shape=dict(rows=args.rows, L=L, K=K, vocab=V, hidden=D), gather={}, grouped=[])
    if args.hidden_grad:
        sweep = [{}] + HIDDEN_GRAD_SWEEP[max(1, args.sweep_from):]            # the default always first
        res["hidden_grad"] = hidden_grad_sweep(weight, cand, args.iters, sweep)
        write_results(args.out, res)
        return

    def gather():
        return candidate_log_probs(q, weight, cand, bias=bias)
    res["gather"] = dict(ms=fwd_bwd_ms(gather, q, args.iters), floor_ms=2 * M * K * D * 2 / 4.8e12 * 1e3,
                         profile=None if args.no_profile else profile(gather, q))
    q.grad = None
    lp_ref = gather()
    lp_ref.sum().backward()
    lp_ref = lp_ref.detach()
    dh_ref = q.grad.float().clone()
    print(f"gather: {res['gather']['ms']:.2f} ms (floor {res['gather']['floor_ms']:.2f})", flush=True)
    for rows in args.groups:
        G = rows * L
        u = union_stats(cand, G, weight)
        default = GroupedTuning.for_shape(M, K, D, G)
        row = dict(rows_per_group=rows, query_rows=G, **u, default=dataclasses.asdict(default), configs=[])
        for tuning in [SWEEP[i] for i in args.sweep] if args.sweep else SWEEP:
            def fn(tuning=tuning):
                t = dict(tuning)
                precision = t.pop("precision", None)
                return grouped_candidate_log_probs(q, weight, cand, G, bias=bias, precision=precision,
                                                   tuning=dataclasses.replace(default, **t))
            try:
                ms = fwd_bwd_ms(fn, q, args.iters)
                q.grad = None
                fn().sum().backward()
                rel = float((q.grad.float() - dh_ref).norm() / dh_ref.norm())
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is recorded
                row["configs"].append(dict(tuning=tuning, error=repr(e)[:300]))
                continue
            row["configs"].append(dict(tuning=tuning, ms=ms, rel_dhidden_vs_gather=rel))
            print(f"group {rows}: {tuning} {ms:.2f} ms (dhidden {rel:.1e} from the gather's)", flush=True)
        fn = lambda: grouped_candidate_log_probs(q, weight, cand, G, bias=bias)  # noqa: E731
        row["profile_default"] = None if args.no_profile else profile(fn, q)
        lp = fn()
        fin = torch.isfinite(lp_ref)
        q.grad = None
        lp.sum().backward()
        row["vs_gather"] = dict(
            same_finite=bool(torch.equal(fin, torch.isfinite(lp))),
            max_abs_logprob=float((lp.detach()[fin] - lp_ref[fin]).abs().max()),
            rel_dhidden=float((q.grad.float() - dh_ref).norm() / dh_ref.norm()))
        res["grouped"].append(row)
        write_results(args.out, res)
    write_results(args.out, res)
    print(f"\n{'group':>5} {'U':>6} {'dist':>5} {'floor':>6} {'best':>7} {'default':>8} {'gather':>7}  best tuning")
    for r in res["grouped"]:
        ok = [c for c in r["configs"] if "ms" in c]
        best = min(ok, key=lambda c: c["ms"])
        print(f"{r['rows_per_group']:>5} {r['union_max']:>6} {r['distinct_fraction']:>5.3f} {r['floor_ms']:>6.2f} "
              f"{best['ms']:>7.2f} {ok[0]['ms']:>8.2f} {res['gather']['ms']:>7.2f}  {best['tuning']}")


if __name__ == "__main__":
    main()
