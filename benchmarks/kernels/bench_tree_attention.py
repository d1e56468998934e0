"""Tree attention vs SDPA with a boolean mask, Qwen3.6-27B attention layers (Hq=24, Hkv=4, D=256).

B = 1, bf16, prefix lengths 1k/4k/16k, n in {16, 65, 129} random topological trees. Per case:
rel-RMS error vs the float64 reference, median time per call (CUDA graph over rotated input sets,
so the KV is not served from L2), and the roofline floor max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s).
Baselines: `F.scaled_dot_product_attention` with the prefix+ancestor bool mask on pre-concatenated
KV, (a) with the KV heads repeated G times beforehand (not timed) and (b) with `enable_gqa=True`.

    python -m benchmarks.kernels.bench_tree_attention --out benchmarks/results/tree_attention_h200.json
    TRITON_INTERPRET=1 python -m benchmarks.kernels.bench_tree_attention --smoke   # CPU check of the script
"""
import argparse
import dataclasses
import json

import torch

from benchmarks.common import copy_bandwidth, env, n_copies, rel_rms, time_calls, write_results
from tfm_kernels.tree_attention.ref import tree_attention_ref
from tfm_kernels.tree_attention.triton import TreeAttentionTuning, launch_config, tree_attention
from tfm_kernels.tree_utils import ancestor_mask, pack_bits

PEAK_BW, PEAK_BF16 = 4.8e12, 989e12
# Tuning sweep (TreeAttentionTuning fields to change from the default; splits_x: that many times the default
# split count), timed on a few cases only.
SWEEP = [dict(block_m=64, block_n=32, num_warps=4), dict(block_m=64, block_n=64, num_warps=4),
         dict(block_m=128, block_n=64, num_warps=8), dict(block_m=128, block_n=32, num_warps=8, num_stages=3),
         dict(block_m=32, block_n=32, num_warps=4, num_stages=3), dict(splits_x=2), dict(splits_x=0.5)]


def make_inputs(L, n, Hq, Hkv, D, dtype, dev, gen, dgen):
    parent = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])[None]
    anc = ancestor_mask(parent).to(dev)

    def rnd(*shape):
        return torch.randn(*shape, generator=dgen, device=dev, dtype=dtype)

    return dict(q=rnd(1, n, Hq, D), k_tree=rnd(1, n, Hkv, D), v_tree=rnd(1, n, Hkv, D),
                k_prefix=rnd(1, L, Hkv, D), v_prefix=rnd(1, L, Hkv, D),
                prefix_len=torch.tensor([L], dtype=torch.int32, device=dev),
                anc=pack_bits(anc), num_nodes=torch.tensor([n], dtype=torch.int32, device=dev), anc_bool=anc)


def sdpa_operands(inp, expand):
    """q [1, Hq, n, D]; k, v [1, Hq or Hkv, L+n, D]; mask [n, L+n] bool (prefix + ancestor-or-self)."""
    Hq, Hkv = inp["q"].shape[2], inp["k_tree"].shape[2]
    k = torch.cat([inp["k_prefix"][0], inp["k_tree"][0]]).transpose(0, 1)
    v = torch.cat([inp["v_prefix"][0], inp["v_tree"][0]]).transpose(0, 1)
    if expand:
        k, v = k.repeat_interleave(Hq // Hkv, 0), v.repeat_interleave(Hq // Hkv, 0)
    n, L = inp["q"].shape[1], inp["k_prefix"].shape[1]
    mask = torch.cat([torch.ones(n, L, dtype=torch.bool, device=k.device), inp["anc_bool"][0]], 1)
    return inp["q"][0].transpose(0, 1)[None].contiguous(), k[None].contiguous(), v[None].contiguous(), mask


def run_sdpa(ops, gqa):
    q, k, v, mask = ops
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def kernel_args(inp):
    return {k: v for k, v in inp.items() if k != "anc_bool"}


def bench_case(L, n, shape, dtype, dev, sweep):
    Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(L * 1000 + n)
    dgen = torch.Generator(device=dev).manual_seed(L * 1000 + n)
    kv_bytes = (L + n) * Hkv * D * 2 * dtype.itemsize
    sets = [make_inputs(L, n, Hq, Hkv, D, dtype, dev, gen, dgen) for _ in range(n_copies(kv_bytes))]
    args = [kernel_args(s) for s in sets]
    ref_o, _ = tree_attention_ref(**args[0])
    row = dict(L=L, n=n, Hq=Hq, Hkv=Hkv, D=D, dtype=str(dtype).replace("torch.", ""),
               mean_visible_tree_keys=round(sets[0]["anc_bool"].float().sum().item() / n, 2))
    default = TreeAttentionTuning.for_shape(n, Hq // Hkv, D, dtype.itemsize)
    cfg = launch_config(1, n, Hq // Hkv, Hkv, D, L, torch.device(dev), default)
    row["config"] = cfg
    row["triton_rel_rms"] = rel_rms(ref_o, tree_attention(**args[0]))
    row["triton"] = time_calls([lambda a=a: tree_attention(**a) for a in args])
    flops = 4 * n * Hq * D * (L + row["mean_visible_tree_keys"])
    io_bytes = kv_bytes + 2 * n * Hq * D * dtype.itemsize
    floor_s = max(io_bytes / PEAK_BW, flops / PEAK_BF16)
    t = row["triton"]["us"] * 1e-6
    row.update(bytes=io_bytes, flops=flops, floor_us=floor_s * 1e6, bound="memory" if io_bytes / PEAK_BW > flops / PEAK_BF16 else "compute",
               time_over_floor=t / floor_s, achieved_tbps=io_bytes / t / 1e12, achieved_tflops=flops / t / 1e12)
    for name, expand, gqa in (("sdpa_expanded_kv", True, False), ("sdpa_enable_gqa", False, True)):
        try:
            ops = [sdpa_operands(s, expand) for s in sets[: n_copies(kv_bytes * (Hq // Hkv if expand else 1))]]
            row[name + "_rel_rms"] = rel_rms(ref_o, run_sdpa(ops[0], gqa)[0].transpose(0, 1)[None])
            row[name] = time_calls([lambda o=o: run_sdpa(o, gqa) for o in ops])
            row[name + "_speedup"] = row[name]["us"] / row["triton"]["us"]
            del ops
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
            row[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if sweep:
        row["sweep"] = []
        for ov in SWEEP:
            ov = dict(ov)
            x = ov.pop("splits_x", None)
            if x is not None:
                ov["num_splits"] = max(1, int(round(cfg["num_splits"] * x)))
            tuning = dataclasses.replace(default, **ov)
            entry = dict(config=launch_config(1, n, Hq // Hkv, Hkv, D, L, torch.device(dev), tuning))

            def fn(a, tuning=tuning):
                return tree_attention(**a, tuning=tuning)
            try:
                entry["rel_rms"] = rel_rms(ref_o, fn(args[0]))
                entry.update(time_calls([lambda a=a: fn(a) for a in args]))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            row["sweep"].append(entry)
    del sets, args
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/tree_attention_h200.json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes (run under TRITON_INTERPRET=1)")
    ap.add_argument("--no-sweep", action="store_true", help="time the default configuration only")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.smoke:
        shape, Ls, ns, sweep_at, dtype = (4, 2, 16), (40, 130), (5, 9), {(130, 9)}, torch.float16
    else:
        shape, Ls, ns, dtype = (24, 4, 256), (1024, 4096, 16384), (16, 65, 129), torch.bfloat16
        sweep_at = {(16384, 16), (16384, 129), (4096, 65), (1024, 65)}
    res = dict(env=env(), op="tree_attention", copy_bandwidth_tbps=copy_bandwidth(),
               peak_assumed=dict(hbm_tbps=PEAK_BW / 1e12, bf16_tflops=PEAK_BF16 / 1e12), cases=[])
    for L in Ls:
        for n in ns:
            res["cases"].append(bench_case(L, n, shape, dtype, dev, (L, n) in sweep_at and not a.no_sweep))
            write_results(a.out, res)  # partial results survive a time-out
    print(f"{'L':>6} {'n':>4} {'triton us':>10} {'sdpa us':>9} {'gqa us':>8} {'speedup':>8} "
          f"{'floor us':>9} {'x floor':>8} {'bound':>8} {'rel-rms':>9}")
    for r in res["cases"]:
        sd, sg = r["sdpa_expanded_kv"].get("us", float("nan")), r["sdpa_enable_gqa"].get("us", float("nan"))
        print(f"{r['L']:>6} {r['n']:>4} {r['triton']['us']:>10.1f} {sd:>9.1f} {sg:>8.1f} {sd / r['triton']['us']:>8.2f} "
              f"{r['floor_us']:>9.1f} {r['time_over_floor']:>8.2f} {r['bound']:>8} {r['triton_rel_rms']:>9.2e}")
        for s in r.get("sweep", []):
            c = s["config"]
            print(f"{'':>11} sweep BM{c['BLOCK_M']} BN{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} "
                  f"S{c['num_splits']}: {s.get('us', float('nan')):.1f} us {s.get('error', '')[:60]}")
    print(json.dumps(res["env"]))


if __name__ == "__main__":
    main()
