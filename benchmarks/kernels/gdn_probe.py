"""Where the GDN tree verify's time goes at one tree size (GPU): each launch alone, and the solve at fewer
value heads (fewer programs per SM: a latency-bound solve keeps its time, a throughput-bound one shrinks).

    python -m benchmarks.kernels.gdn_probe --n 129 --out out/gdn_probe.json
    python -m benchmarks.kernels.gdn_probe --n 129 --once      # one eager verify (for a profiler such as ncu)

Qwen3.6-27B GDN shape (H=16, K=V=128; HV=48 unless --hv), a chain of n nodes, B=1, the default
configuration for a tree rooted at node 0; median microseconds under CUDA graphs over 16 layers' inputs.
"""
import argparse
import json

import torch

from benchmarks.common import env, write_results
from benchmarks.kernels.bench_gdn_tree import graph_time, verify_call
from benchmarks.kernels.gdn_tree_cases import make_inputs
from tfm_kernels.gdn_tree.tree import tree_ancestor_bits


def inputs(n, hv, seed):
    """A chain of n nodes at HV=hv value heads (B=1, bf16), its ancestor bits built once."""
    d = make_inputs(1, n, [n], "chain", torch.bfloat16, seed=seed, P=2, HV=hv)[1]
    d["anc"] = tree_ancestor_bits(d["parent"], d["num"])
    return d


def call(d, stages, **cfg):
    return verify_call(d, dict(cfg, single_root=True), stages)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=129)
    ap.add_argument("--hv", type=int, nargs="+", default=[48, 16])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--once", action="store_true", help="one eager verify at HV=48 after a warm-up, no timing")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.once:
        d = inputs(a.n, 48, 0)
        call(d, ("prep", "solve"))
        torch.cuda.synchronize()
        call(d, ("prep", "solve"))
        torch.cuda.synchronize()
        return
    res = dict(env=env(), n=a.n, kind="chain", rows=[])
    stage_sets = {"verify": ("prep", "solve"), "prep": ("prep",), "diag": ("diag",), "tiles": ("tiles",),
                  "solve": ("solve",)}
    for hv in a.hv:
        sets = [inputs(a.n, hv, 100 + i) for i in range(a.layers)]
        for d in sets:
            call(d, ("prep", "solve"))                                 # the stashes every stage reads
        row = dict(hv=hv, programs_solve=8 * hv)
        want = call(sets[0], ("prep", "solve"))[0].float()
        for name, st in stage_sets.items():
            row[name + "_us"] = graph_time([lambda d=d, st=st: call(d, st) for d in sets])
        # other launch parameters, each launch alone
        for name, st, cfg in (("solve_bv32_w4", "solve", dict(block_v=32)), ("solve_w2", "solve", dict(num_warps=2)),
                              ("solve_w8", "solve", dict(num_warps=8)),
                              ("diag_w1", "diag", dict(diag_warps=1)), ("diag_w2", "diag", dict(diag_warps=2)),
                              ("tiles_w2", "tiles", dict(prep_warps=2)), ("tiles_w1", "tiles", dict(prep_warps=1)),
                              ("verify_diag_w2_tiles_w2", "verify", dict(diag_warps=2, prep_warps=2)),
                              ("verify_diag_w1_tiles_w2", "verify", dict(diag_warps=1, prep_warps=2))):
            try:
                if st == "verify":                    # same outputs as the default (up to summation order)
                    got = call(sets[0], ("prep", "solve"), **cfg)[0].float()
                    row[name + "_max_rel_diff"] = ((got - want).abs().max() / want.abs().max()).item()
                row[name + "_us"] = graph_time([lambda d=d, st=stage_sets[st], cfg=cfg: call(d, st, **cfg)
                                                for d in sets])
            except Exception as e:  # noqa: BLE001 - a configuration the compiler rejects is recorded
                row[name + "_error"] = repr(e)[:200]
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        write_results(a.out, res)
    for r in res["rows"]:
        print(f"HV={r['hv']}: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_us")))


if __name__ == "__main__":
    main()
