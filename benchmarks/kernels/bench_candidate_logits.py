"""Candidate logits vs torch baselines, Qwen3.6-27B LM head (Vocab 248320, hidden 5120), bf16.

Per (M, Kc): rel-RMS error of the logits and max abs error of the logprobs vs float64, median time
per call (CUDA graph over rotated candidate sets, so rows are not served from L2), and the memory
floor `(M*Kc*Dm*2 + M*Dm*2) / 4.8 TB/s` (also against the measured copy bandwidth). Baselines:
`weight[cand]` materialised + bmm + log_softmax, and the full LM head + gather + log_softmax.

    python -m benchmarks.kernels.bench_candidate_logits --out benchmarks/results/candidate_logits_h200.json
    TRITON_INTERPRET=1 python -m benchmarks.kernels.bench_candidate_logits --smoke   # CPU check of the script
"""
import argparse
import dataclasses
import json

import torch

from benchmarks.common import copy_bandwidth, env, n_copies, rel_rms, time_calls, write_results
from tfm_kernels.candidate_logits.ref import candidate_logits_full_head, candidate_logits_gather, candidate_logits_ref
from tfm_kernels.candidate_logits.triton import CandidateTuning, candidate_logits

PEAK_BW = 4.8e12
# Tuning sweep, timed on a few cases only: (block_k, block_d, num_warps, num_stages) without prefetch, or dicts of
# CandidateTuning fields over 8 x 1024 tiles, 4 warps, 3 stages with prefetch.
SWEEP = [(32, 256, 4, 3), (16, 512, 4, 3), (8, 1024, 4, 3), (4, 2048, 4, 3), (16, 256, 4, 4), (32, 256, 8, 4),
         (8, 512, 4, 4),
         # around 4 x 2048 (hidden 5120 is 2.5 blocks of 2048: 1024 divides it)
         (4, 1024, 4, 3), (4, 2048, 4, 2), (4, 2048, 4, 4), (4, 2048, 8, 3), (2, 2048, 4, 3), (2, 4096, 4, 3),
         # the next hidden block's loads issued before this block's products
         dict(block_k=4, block_d=2048), dict(block_k=4, block_d=1024), dict(block_k=8, block_d=1024),
         dict(block_k=2, block_d=2048), dict(block_k=8, block_d=512), dict(block_k=16, block_d=256),
         dict(block_k=4, block_d=2048, num_warps=8), dict(block_k=8, block_d=1024, num_warps=8),
         dict(block_k=4, block_d=512), dict(block_k=2, block_d=1024)]


def sweep_tuning(entry: tuple | dict) -> CandidateTuning:
    """A SWEEP entry as a CandidateTuning."""
    if isinstance(entry, dict):
        return CandidateTuning(**dict(dict(block_k=8, block_d=1024, num_warps=4, num_stages=3, prefetch=True), **entry))
    return CandidateTuning(*entry, prefetch=False)


def make_sets(M, Kc, Dm, V, dtype, dev, gen, copies):
    sets = []
    for _ in range(copies):
        hidden = torch.randn(M, Dm, generator=gen, device=dev, dtype=dtype)
        cand = torch.randint(0, V, (M, Kc), generator=gen, device=dev, dtype=torch.int32)
        sets.append((hidden, cand))
    return sets


def bench_case(M, Kc, weight, dev, sweep: list):
    V, Dm = weight.shape
    gen = torch.Generator(device=dev).manual_seed(M * 131 + Kc)
    es = weight.element_size()
    floor_bytes = M * Kc * Dm * es + M * Dm * es
    sets = make_sets(M, Kc, Dm, V, weight.dtype, dev, gen, n_copies(floor_bytes, cap=64))
    hidden, cand = sets[0]
    # Correctness with every option on (per-row temperature, bias, a pad), then timing of the plain call.
    cand_chk = cand.clone()
    cand_chk[0, -1] = -1
    bias = torch.randn(M, Kc, generator=gen, device=dev)
    inv_t = 0.5 + torch.rand(M, generator=gen, device=dev)
    lg, lp, _ = candidate_logits(hidden, weight, cand_chk, inv_t, return_lse=True, bias=bias)
    r_lg, r_lp, _ = candidate_logits_ref(hidden, weight, cand_chk, inv_t, bias)
    fin = torch.isfinite(r_lg)
    row = dict(M=M, Kc=Kc, Dm=Dm, vocab=V, dtype=str(weight.dtype).replace("torch.", ""),
               config=dataclasses.asdict(CandidateTuning.for_shape(M, Kc, Dm, torch.device(dev))),
               floor_bytes=floor_bytes,
               logits_rel_rms=rel_rms(r_lg[fin], lg[fin]),
               logprobs_max_abs_err=(lp.double()[fin] - r_lp[fin]).abs().max().item(),
               inf_pattern_ok=bool(torch.equal(torch.isfinite(lg), fin)))
    row["triton"] = time_calls([lambda h=h, c=c: candidate_logits(h, weight, c) for h, c in sets])
    t = row["triton"]["us"] * 1e-6
    row.update(floor_us=floor_bytes / PEAK_BW * 1e6, time_over_floor=t * PEAK_BW / floor_bytes,
               achieved_tbps=floor_bytes / t / 1e12)
    for name, fn in (("gather_bmm", candidate_logits_gather), ("full_head", candidate_logits_full_head)):
        try:
            g_lg, _ = fn(hidden, weight, cand)
            r0, _, _ = candidate_logits_ref(hidden, weight, cand)
            row[name + "_logits_rel_rms"] = rel_rms(r0, g_lg)
            use = sets if name == "gather_bmm" else sets[:1]  # the full head reads all rows anyway
            row[name] = time_calls([lambda h=h, c=c: fn(h, weight, c) for h, c in use])
            row[name + "_speedup"] = row[name]["us"] / row["triton"]["us"]
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
            row[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if sweep:
        row["sweep"] = []
        for e in sweep:
            tuning = sweep_tuning(e)
            entry = dict(config=dataclasses.asdict(tuning))
            try:
                s_lg, s_lp = candidate_logits(hidden, weight, cand, tuning=tuning)
                r_lg, r_lp, _ = candidate_logits_ref(hidden, weight, cand)
                entry["logits_rel_rms"] = rel_rms(r_lg, s_lg)
                entry["logprobs_max_abs_err"] = (s_lp.double() - r_lp).abs().max().item()
                entry.update(time_calls([lambda h=h, c=c: candidate_logits(h, weight, c, tuning=tuning)
                                         for h, c in sets]))
                entry["time_over_floor"] = entry["us"] * 1e-6 * PEAK_BW / floor_bytes
            except Exception as e:  # noqa: BLE001 - e.g. a tile the compiler rejects
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            row["sweep"].append(entry)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/candidate_logits_h200.json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes (run under TRITON_INTERPRET=1)")
    ap.add_argument("--cases", help="only these MxKc cases, e.g. 64x512,65x512 (default: all)")
    ap.add_argument("--sweep-from", type=int, default=0, help="sweep only SWEEP[i:] (default: all of it)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.smoke:
        V, Dm, dtype = 1000, 100, torch.float16
        cases, sweep_at = [(1, 20), (3, 9)], {(3, 9)}
    else:
        V, Dm, dtype = 248320, 5120, torch.bfloat16
        cases = [(1, 512), (8, 512), (64, 512), (65, 512), (256, 512), (65, 8), (65, 64), (4096, 8)]
        sweep_at = {(1, 512), (64, 512), (65, 512), (256, 512)}
    if a.cases:
        want = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
        cases = [c for c in cases if c in want] or want
    gen = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(V, Dm, generator=gen, device=dev, dtype=dtype) * 0.02)
    bw = copy_bandwidth()
    res = dict(env=env(), op="candidate_logits", copy_bandwidth_tbps=bw,
               peak_assumed=dict(hbm_tbps=PEAK_BW / 1e12), cases=[])
    for M, Kc in cases:
        row = bench_case(M, Kc, weight, dev, SWEEP[a.sweep_from:] if (M, Kc) in sweep_at else [])
        if bw:
            row["time_over_measured_copy_bw_floor"] = row["triton"]["us"] * 1e-6 * bw * 1e12 / row["floor_bytes"]
        res["cases"].append(row)
        write_results(a.out, res)  # partial results survive a time-out
    print(f"{'M':>5} {'Kc':>4} {'triton us':>10} {'gather us':>10} {'full us':>9} {'floor us':>9} "
          f"{'x floor':>8} {'TB/s':>6} {'lg relrms':>10} {'lp abs':>8}")
    for r in res["cases"]:
        g, f = r["gather_bmm"].get("us", float("nan")), r["full_head"].get("us", float("nan"))
        print(f"{r['M']:>5} {r['Kc']:>4} {r['triton']['us']:>10.2f} {g:>10.2f} {f:>9.1f} {r['floor_us']:>9.2f} "
              f"{r['time_over_floor']:>8.2f} {r['achieved_tbps']:>6.2f} {r['logits_rel_rms']:>10.2e} "
              f"{r['logprobs_max_abs_err']:>8.1e}")
        for s in r.get("sweep", []):
            c = s["config"]
            p = " pf" if c["prefetch"] else ""
            print(f"{'':>11} sweep K{c['block_k']} D{c['block_d']} w{c['num_warps']} s{c['num_stages']}{p}: "
                  f"{s.get('us', float('nan')):.2f} us ({s.get('time_over_floor', float('nan')):.2f}x) "
                  f"{s.get('error', '')[:60]}")
    print(f"copy bandwidth {bw} TB/s; " + json.dumps(res["env"]))


if __name__ == "__main__":
    main()
