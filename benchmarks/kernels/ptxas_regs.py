"""Registers and spills of the GDN tree kernels on sm_90, compiled on a machine without a GPU.

    python -m benchmarks.kernels.ptxas_regs prep:16:32:3:4 solve:16:16:4:64 [--maxnreg 128] [--pdl]

prep:BT:BC:NW:warps[:part] (part 0: one launch, 1: diagonal programs, 2: tiles of a split prep; the
diagonal inverse over 8-node blocks)
and solve:BT:BV:warps:KC (Qwen3.6-27B shapes: K = V = 128, bf16 q/k/v,
GV = 3). Triton lowers to PTX for the target without a driver; the ptxas shipped with Triton
reports registers and spill bytes (`-v`), which decide how many programs fit on an SM.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tfm_kernels.gdn_tree.prep import tree_gdn_prep_kernel
from tfm_kernels.gdn_tree.verify import tree_gdn_solve_kernel

INTS = ("N", "H", "HV", "K", "V", "NB", "NPAD")
PTRS = dict(q="*bf16", k="*bf16", v="*bf16", o="*bf16", anc="*i32", num_nodes="*i32", state_idx="*i32")


def ptxas_report(fn, consts, num_warps, maxnreg=None, num_stages=3):
    """'R registers, S B spill' of `fn` specialised on `consts` for sm_90a."""
    sig = {a: "i32" if a in INTS else "fp32" if a == "scale" else PTRS.get(a, "*fp32") for a in fn.arg_names}
    sig.update({c: "constexpr" for c in consts})
    opts = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")
                 if os.path.exists(os.path.join(bindir, n)))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True).stderr
    regs, spill = re.search(r"Used (\d+) registers", err), re.search(r"(\d+) bytes spill stores", err)
    if not regs:
        raise RuntimeError(f"ptxas failed: {err[-500:]}")
    return f"{regs.group(1)} registers, {spill.group(1) if spill else 0} B spill stores"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", help="prep:BT:BC:NW:warps[:part] or solve:BT:BV:warps:KC")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (prep launches)")
    ap.add_argument("--pdl", action="store_true", help="with programmatic dependent launch")
    ap.add_argument("--root", action="store_true", help="with the root fold (single_root)")
    args = ap.parse_args()
    for spec in args.specs:
        kind, *v = spec.split(":")
        v = [int(x) for x in v]
        if kind == "prep" and len(v) in (4, 5):
            c = dict(NW=v[2], BT=v[0], BK=128, BC=v[1], USE_L2NORM=True, DOT_PREC="tf32", PDL=args.pdl,
                     PART=v[4] if len(v) == 5 else 0, ROOT=int(args.root), INV_BASE=8, INV_PREC="tf32x3")
            print(spec, ptxas_report(tree_gdn_prep_kernel, c, v[3], args.maxnreg), flush=True)
        elif kind == "solve" and len(v) == 4:
            c = dict(BT=v[0], BK=128, BV=v[1], KC=v[3], STATE_V_FIRST=False, DOT_PREC="tf32",
                     PDL=args.pdl, ROOT=int(args.root), USE_L2NORM=True)
            print(spec, ptxas_report(tree_gdn_solve_kernel, c, v[2], num_stages=1), flush=True)  # as launched
        else:
            sys.exit(f"expected prep:BT:BC:NW:warps[:part] or solve:BT:BV:warps:KC, got {spec!r}")


if __name__ == "__main__":
    main()
