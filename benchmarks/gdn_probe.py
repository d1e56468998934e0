"""Where the GDN tree verify's time goes at one tree size (GPU): each launch alone, and the solve at fewer
value heads (fewer programs per SM: a latency-bound solve keeps its time, a throughput-bound one shrinks).

    python benchmarks/gdn_probe.py --n 129 --out out/gdn_probe.json
    python benchmarks/gdn_probe.py --n 129 --once      # one eager verify (for a profiler such as ncu)

Qwen3.6-27B GDN shape (H=16, K=V=128; HV=48 unless --hv), a chain of n nodes, B=1, the default
configuration for a tree rooted at node 0; median microseconds under CUDA graphs over 16 layers' inputs.
"""
import argparse
import json

import torch
from _timing import env_info  # (also puts the repo root on sys.path)

from benchmarks.bench_gdn_tree import graph_time
from kernels.gdn_tree import ref, tree_gdn_verify
from kernels.gdn_tree.tree import tree_ancestor_bits
from tfm_runtime.io import atomic_write_json

H, K = 16, 128


def inputs(n, hv, seed):
    gen = torch.Generator().manual_seed(seed)
    parent = ref.make_tree(n, "chain", generator=gen).int()[None]
    d = dict(q=torch.randn(1, n, H, K, generator=gen), k=torch.randn(1, n, H, K, generator=gen),
             v=torch.randn(1, n, hv, K, generator=gen),
             g=torch.nn.functional.logsigmoid(torch.randn(1, n, hv, generator=gen)),
             beta=torch.rand(1, n, hv, generator=gen), pool=torch.randn(2, hv, K, K, generator=gen) * 0.5)
    d = {k: v.cuda() for k, v in d.items()}
    for x in ("q", "k", "v"):
        d[x] = d[x].bfloat16()
    d["num"] = torch.tensor([n], dtype=torch.int32, device="cuda")
    d["sidx"] = torch.tensor([0], dtype=torch.int32, device="cuda")
    d["anc"] = tree_ancestor_bits(parent.cuda(), d["num"])
    return d


def call(d, stages, **cfg):
    return tree_gdn_verify(d["q"], d["k"], d["v"], d["g"], d["beta"], None, d["num"], d["pool"], d["sidx"],
                           anc=d["anc"], single_root=True, stages=stages, **cfg)


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
    res = dict(env=env_info(), n=a.n, kind="chain", rows=[])
    stage_sets = {"verify": ("prep", "solve"), "prep": ("prep",), "diag": ("diag",), "tiles": ("tiles",),
                  "solve": ("solve",)}
    for hv in a.hv:
        sets = [inputs(a.n, hv, 100 + i) for i in range(a.layers)]
        for d in sets:
            call(d, ("prep", "solve"))                                 # the stashes every stage reads
        row = dict(hv=hv, programs_solve=8 * hv)
        for name, st in stage_sets.items():
            row[name + "_us"] = graph_time([lambda d=d, st=st: call(d, st) for d in sets])
        for bv, nw in ((32, 4), (32, 8)):
            row[f"solve_bv{bv}_w{nw}_us"] = graph_time([lambda d=d: call(d, ("solve",), block_v=bv, num_warps=nw)
                                                        for d in sets])
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        atomic_write_json(a.out, res)
    print(f"{'HV':>4} " + " ".join(f"{k[:-3]:>16}" for k in res["rows"][0] if k.endswith("_us")))
    for r in res["rows"]:
        print(f"{r['hv']:>4} " + " ".join(f"{v:>16.2f}" for k, v in r.items() if k.endswith("_us")))


if __name__ == "__main__":
    main()
