"""Weaver's small attention: the fused Triton kernel vs the batched-matmul path, forward and forward+backward.

Qwen3.6-27B preset training shape: B = 1024 rows, nh = 8, T = S = 31 (chain mask, L = 15), hd = 128, bf16;
q, k, v are views of one qkv projection output [B, T, 3, nh, hd] as in `WeaverBlock.qkv`. Per path: rel-RMS
of o against the float64 reference (first 64 rows), median time per call (CUDA graph; `benchmarks.common.time_calls`),
and the memory floor bytes / 4.8 TB/s (forward: read q, k, v, write o; backward: read q, k, v, do, write
dq, dk, dv; the fp32 lse is counted too). Paths: `kernel` (tfm_kernels.small_attention), `bmm` (eager
`_small_attention_bmm` of tfm_runtime/models/weaver.py) and `bmm_compiled` (the same under torch.compile, as
the training step runs it).

    python -m benchmarks.kernels.bench_small_attention --out benchmarks/results/small_attention_h200.json
"""
import argparse
import json

import torch

from benchmarks.common import copy_bandwidth, env, n_copies, rel_rms, time_calls, write_results
from tfm_kernels.small_attention import small_attention, small_attention_ref
from tfm_runtime.models.weaver import _small_attention_bmm, chain_mask

PEAK_BW = 4.8e12


def make_set(B, nh, T, hd, dtype, dev, gen):
    """One input set: the qkv leaf [B, T, 3, nh, hd] and do [B, nh, T, hd] (a view of [B, T, nh, hd])."""
    qkv = torch.randn(B, T, 3, nh, hd, generator=gen, device=dev, dtype=dtype).requires_grad_()
    do = torch.randn(B, T, nh, hd, generator=gen, device=dev, dtype=dtype).transpose(1, 2)
    return qkv, do


def fwd(path, qkv, mask):
    q, k, v = qkv.permute(2, 0, 3, 1, 4)                                          # [B, nh, T, hd] views
    return path(q, k, v, mask)


def fwd_bwd(path, qkv, do, mask):
    """dq, dk, dv of the views (not of the qkv leaf: stacking them into [B, T, 3, nh, hd] is no part of either path)."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return torch.autograd.grad(path(q, k, v, mask), (q, k, v), do)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/small_attention_h200.json")
    ap.add_argument("--rows", type=int, default=1024, help="B (training rows)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_attention needs a CUDA device")
    dev, dtype, (B, nh, L, hd) = "cuda", torch.bfloat16, (a.rows, 8, 15, 128)
    T = 2 * L + 1
    mask = chain_mask(L, dev)[None, None]                                         # [1, 1, T, T]
    gen = torch.Generator(device=dev).manual_seed(0)
    tensor_bytes = B * nh * T * hd * dtype.itemsize
    lse_bytes = B * nh * T * 4
    sets = [make_set(B, nh, T, hd, dtype, dev, gen) for _ in range(n_copies(4 * tensor_bytes))]
    floors = dict(fwd=(4 * tensor_bytes + lse_bytes) / PEAK_BW * 1e6,
                  fwd_bwd=(11 * tensor_bytes + 2 * lse_bytes) / PEAK_BW * 1e6)
    paths = dict(kernel=small_attention, bmm=_small_attention_bmm,
                 bmm_compiled=torch.compile(_small_attention_bmm))
    qkv0 = sets[0][0][:64]
    ref = small_attention_ref(*qkv0.detach().permute(2, 0, 3, 1, 4), mask)
    res = dict(env=env(), op="small_attention", copy_bandwidth_tbps=copy_bandwidth(),
               shape=dict(B=B, nh=nh, T=T, S=T, hd=hd, dtype="bfloat16", mask="chain L=15"),
               peak_assumed=dict(hbm_tbps=PEAK_BW / 1e12), floor_us=floors, paths={})
    for name, path in paths.items():
        row = dict(rel_rms=rel_rms(ref, fwd(path, qkv0, mask).detach()))
        with torch.no_grad():
            row["fwd"] = time_calls([lambda s=s: fwd(path, s[0], mask) for s in sets])
        row["fwd_bwd"] = time_calls([lambda s=s: fwd_bwd(path, s[0], s[1], mask) for s in sets])
        for kind in ("fwd", "fwd_bwd"):
            row[kind + "_over_floor"] = row[kind]["us"] / floors[kind]
        res["paths"][name] = row
        write_results(a.out, res)                                            # partial results survive a time-out
    print(f"B={B} nh={nh} T=S={T} hd={hd} bf16; floors: fwd {floors['fwd']:.1f} us, fwd+bwd {floors['fwd_bwd']:.1f} us")
    print(f"{'path':>13} {'fwd us':>9} {'x floor':>8} {'fwd+bwd us':>11} {'x floor':>8} {'rel-rms':>9}")
    for name, r in res["paths"].items():
        print(f"{name:>13} {r['fwd']['us']:>9.1f} {r['fwd_over_floor']:>8.2f} {r['fwd_bwd']['us']:>11.1f} "
              f"{r['fwd_bwd_over_floor']:>8.2f} {r['rel_rms']:>9.2e}")
    print(json.dumps(res["env"]))


if __name__ == "__main__":
    main()
