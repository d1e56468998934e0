"""Weaver training throughput: samples/s, achieved TFLOP/s and MFU against the measured bf16 matmul rate.

One GPU:   python -m benchmarks.pipelines.train_bench --preset qwen36_27b --out benchmarks/results/train_h200.json
Two GPUs:  deepspeed --num_gpus 2 --module benchmarks.pipelines.train_bench --preset qwen36_27b \
               --out .../train_2gpu_h200.json
CPU smoke: python -m benchmarks.pipelines.train_bench --preset tiny --steps 3 --warmup 1

Synthetic anchor rows with the shard shapes of the preset (rows are random: step time does not depend on values)
go through the real trainer objective under DeepSpeed (ZeRO-2, bf16 on GPU). The global batch is fixed, so a
2-GPU run halves the per-rank micro batch and its loss trace is comparable with the 1-GPU run's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

PRESETS = {
    # d_model, vocab, lookahead, candidate pool, target top-k, Weaver (d_rank, layers, heads, mlp)
    "qwen36_27b": dict(d_model=5120, vocab=248320, L=15, K=512, k=32, weaver=None),
    "tiny": dict(d_model=64, vocab=262, L=7, K=64, k=16, weaver=(32, 2, 2, 64)),
}


def replay_candidates(n: int, L: int, K: int, V: int, seed: int) -> torch.Tensor:
    """[n, L, K] candidate ids with the overlap of real ones: each row is a random anchor's L consecutive
    top-K sets of SmolLM2-135M (benchmarks/data/smollm2_top512.npz, see candidate_overlap), its token ids
    mapped into [0, V) by a fixed random injection (the preset's vocabulary is larger)."""
    import numpy as np

    from benchmarks.pipelines.candidate_overlap import DATA, load_sets
    sets, v_src = load_sets(os.path.join(DATA, "smollm2_top512.npz"))
    if K > sets[0].shape[1] or V < v_src:
        raise SystemExit(f"--candidates replay holds {sets[0].shape[1]} candidates over {v_src} tokens; "
                         f"the preset wants K={K} over V={V}")
    rng = np.random.default_rng(seed)
    inject = np.random.default_rng(0).permutation(V)[:v_src]
    anchors = [(i, a) for i, s in enumerate(sets) for a in range(len(s) - L + 1)]
    pick = rng.choice(len(anchors), n)
    rows = np.stack([sets[anchors[j][0]][anchors[j][1]:anchors[j][1] + L, :K] for j in pick])
    return torch.from_numpy(inject[rows])


def synthetic_rows(n: int, p: dict, seed: int, device, candidates: str = "uniform") -> dict[str, torch.Tensor]:
    """n anchor rows; a quarter of the target's top-k overlaps the candidates, as in real shards. Candidates are
    uniform over the vocabulary (no reuse: the worst case for caches) or `replay`ed real sets."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    L, K, k, V, H = p["L"], p["K"], p["k"], p["vocab"], p["d_model"]
    if candidates == "replay":
        cand = replay_candidates(n, L, K, V, seed)
    else:
        cand = torch.randint(0, V, (n, L, K), generator=g)
    topk = torch.randint(0, V, (n, L, k), generator=g)
    topk[..., : k // 4] = cand[..., : k // 4]
    rows = {"h_final": torch.randn(n, H, generator=g), "dflash_hidden": torch.randn(n, L, H, generator=g),
            "root_token": torch.randint(0, V, (n,), generator=g), "cand_ids": cand,
            "cand_logits": torch.randn(n, L, K, generator=g) * 3,
            "true_tokens": cand[..., 0].clone(), "target_topk_ids": topk,
            "target_topk_logprobs": torch.log_softmax(torch.randn(n, L, k, generator=g), -1),
            "loss_mask": torch.ones(n, L, dtype=torch.bool)}
    return {name: t.to(device) for name, t in rows.items()}


def matmul_peak_tflops(device, dtype=torch.bfloat16, n: int = 8192, iters: int = 20) -> float:
    """The measured dense matmul rate (the MFU denominator): the best of 5 timings of `iters` products (one
    timing moved by up to 10% between runs of session 8, with the GPU's clocks)."""
    if device.type != "cuda":
        n, iters = 512, 3
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        best = max(best, 2 * n ** 3 * iters / (time.perf_counter() - t) / 1e12)
    return best


def step_once(engine, batch: dict, rank: int, micro: int, host: dict | None = None) -> torch.Tensor:
    """One optimizer step on this rank's rows of `batch` -> the loss; `host` (if given) adds up the host
    seconds of the forward, backward and step calls (no sync inside)."""
    t0 = time.perf_counter()
    loss, _ = engine({n: t[rank * micro:(rank + 1) * micro] for n, t in batch.items()})
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    if host is not None:
        host["forward"] += t1 - t0
        host["backward"] += t2 - t1
        host["step"] += time.perf_counter() - t2
    return loss


def sync_sites(fn, frames: int = 6) -> list[str]:
    """Where `fn` makes the host wait on the GPU: the innermost frames of each distinct call site that CUDA's
    sync debug mode warns about."""
    import traceback
    import warnings
    torch.cuda.synchronize()
    sites = []

    def record(*_args, **_kw):
        site = "".join(traceback.format_stack()[-frames - 1:-1])
        if site not in sites and "set_sync_debug_mode" not in site:
            sites.append(site)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for s in sites:
        print("host sync at:\n" + s, flush=True)
    return sites


def union_stats(cand: torch.Tensor, group: int, lm_head: torch.Tensor) -> dict:
    """Groups of `group` query rows of cand [M, K]: the largest union, the fraction of distinct ids, and the
    grouped scoring's memory floor (both passes read each group's distinct LM-head rows once, 4.8 TB/s)."""
    from tfm_kernels.candidate_logits.union import group_union
    union, _, count = group_union(cand, group, lm_head.shape[0])
    distinct = int((union >= 0).sum())
    return {"union_max": int(count.max()), "distinct_fraction": distinct / cand.numel(),
            "floor_ms": 2 * distinct * lm_head.shape[1] * lm_head.element_size() / 4.8e12 * 1e3}


def score_time_ms(cand: torch.Tensor, p: dict, lm_head: torch.Tensor, torch_scores: bool, group_rows: int = 8,
                  iters: int = 10) -> dict:
    """Forward + backward of the candidate scoring alone for candidates [rows, L, K] (rows x L queries), against
    the gather's memory floor (both passes read rows*L*K*d LM-head elements once, bf16, 4.8 TB/s): the gather
    kernels (or weight[cand] + bmm with `torch_scores`), and the grouped kernels with `group_rows` rows per
    group, whose floor is 2 * (distinct ids per group) * d elements."""
    from benchmarks.common import fwd_bwd_ms
    from tfm_kernels.candidate_logits import candidate_log_probs
    from tfm_kernels.candidate_logits.grouped import grouped_candidate_log_probs
    rows, L, K = cand.shape
    M, d, dev = rows * L, p["d_model"], lm_head.device
    q = torch.randn(M, d, device=dev, dtype=lm_head.dtype, requires_grad=True)
    cand = cand.reshape(M, K).to(dev)
    bias = torch.randn(M, K, device=dev)
    if torch_scores:
        ms = fwd_bwd_ms(lambda: torch.log_softmax(bias + (lm_head[cand] @ q.unsqueeze(-1)).squeeze(-1).float(), -1),
                        q, iters)
    else:
        ms = fwd_bwd_ms(lambda: candidate_log_probs(q, lm_head, cand, bias=bias), q, iters)
    G = group_rows * L
    u = union_stats(cand, G, lm_head)
    grouped = fwd_bwd_ms(lambda: grouped_candidate_log_probs(q, lm_head, cand, G, bias=bias), q, iters)
    return {"ms": ms, "floor_ms": 2 * M * K * d * lm_head.element_size() / 4.8e12 * 1e3,
            "grouped": {"rows_per_group": group_rows, "ms": grouped, "distinct_fraction": u["distinct_fraction"],
                        "floor_ms": u["floor_ms"]}}


KERNEL_KINDS = (("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
                ("attention", ("fmha", "attention", "flash", "attn", "sdpa")),
                ("candidate scoring", ("candidate", "grouped_")),
                ("optimizer", ("multi_tensor", "adam", "foreach")),
                ("inductor fused", ("triton_",)),                          # before copy: their names list ops
                ("sort/unique", ("sort", "unique", "histogram", "scan")),
                ("copy/fill", ("memcpy", "memset", "copy", "fill", "cat", "index")))


def kernel_breakdown(prof, steps: int) -> dict:
    """GPU kernel time per step of a torch.profiler run, by kind (first match of KERNEL_KINDS by name, else
    "other"), with launch counts: where the step's GPU time goes, and how many kernels it launches."""
    kinds: dict[str, dict] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "other")
        d = kinds.setdefault(kind, {"ms_per_step": 0.0, "launches_per_step": 0.0})
        d["ms_per_step"] += e.time_range.elapsed_us() / 1e3 / steps
        d["launches_per_step"] += 1 / steps
    total = sum(d["ms_per_step"] for d in kinds.values())
    return {"gpu_busy_ms_per_step": total, "by_kind": {k: {n: round(v, 3) for n, v in d.items()}
                                                      for k, d in sorted(kinds.items(), key=lambda x: -x[1]["ms_per_step"])}}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen36_27b")
    ap.add_argument("--global-batch", type=int, default=128, help="rows per optimizer step, all ranks together")
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--loss", choices=["kl", "ce"], default="kl")
    ap.add_argument("--torch-scores", action="store_true",
                    help="score candidates through weight[cand] + bmm instead of the Triton gather kernels")
    ap.add_argument("--candidates", choices=["uniform", "replay"], default="uniform",
                    help="candidate ids uniform over the vocabulary, or real overlapping sets replayed from "
                         "benchmarks/data/smollm2_top512.npz")
    ap.add_argument("--score-group", type=int, default=4, help="rows per group of the grouped scoring (the train "
                                                                "config's score_group_rows)")
    ap.add_argument("--step-scoring", choices=["gather", "grouped"], default="grouped",
                    help="candidate scoring inside the training step: per-candidate gathers, or grouped "
                         "(--score-group rows per group; the train config's score_group_rows)")
    ap.add_argument("--score-tuning", help="with --step-scoring grouped: GroupedTuning fields to change from the "
                                           'default, as JSON, e.g. {"bwd_bd": 256}')
    ap.add_argument("--compile", action="store_true", help="torch.compile the objective's forward (as the train config's compile: auto does on GPU)")
    ap.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                    default="default", help="torch.compile mode with --compile (reduce-overhead: CUDA graphs for the "
                                            "compiled parts of the step)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of 3 profiled steps (rank 0)")
    ap.add_argument("--trace", help="with --profile: also write the chrome trace of the profiled steps here")
    ap.add_argument("--sync-debug", action="store_true",
                    help="run one step under CUDA's sync debug mode and print where the host waits on the GPU")
    ap.add_argument("--reference-peak-tflops", type=float, default=808.0,
                    help="a fixed MFU denominator per GPU, reported beside this machine's measured matmul rate (which "
                         "moved between 652 and 808 TFLOP/s over H200s of sessions 7-11). Default: 808, the best "
                         "measured on an H200 here (session 11; the dense bf16 spec is 989)")
    ap.add_argument("--out", help="write the JSON result here (rank 0)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import deepspeed
    import torch.distributed as dist

    from benchmarks.common import env, write_results
    from pipelines.train.config import TrainConfig
    from pipelines.train.loop import init_distributed
    from pipelines.train.optim import make_optimizer
    from pipelines.train.weaver_task import WeaverObjective, depth_weights, flops_per_row, initial_weaver
    from tfm_kernels.candidate_logits.grouped import GroupedTuning
    from tfm_runtime.models.weaver import WeaverConfig, WeaverScoring

    cuda = torch.cuda.is_available()
    rank, world, local = init_distributed("cuda" if cuda else "cpu")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    scores = ("torch weight[cand] + bmm" if args.torch_scores or not cuda else
              f"triton grouped kernels ({args.score_group} rows per group)" if args.step_scoring == "grouped" else
              "triton gather kernels")
    p = PRESETS[args.preset]
    if p["weaver"] is None:
        wcfg = WeaverConfig.qwen36_27b()
    else:
        r, nl, nh, m = p["weaver"]
        wcfg = WeaverConfig(d_model=p["d_model"], d_embed=p["d_model"], d_rank=r, num_layers=nl, num_heads=nh,
                            mlp_dim=m, lookahead=p["L"], candidate_pool=p["K"])
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
    micro = args.global_batch // world
    g = torch.Generator(device=device).manual_seed(0)                 # on the device: 1.3G values at the preset
    embed = torch.randn(p["vocab"], p["d_model"], generator=g, device=device).to(dtype) * 0.02
    lm_head = torch.randn(p["vocab"], p["d_model"], generator=g, device=device).to(dtype) * 0.02
    scoring = WeaverScoring(kernels=not args.torch_scores)
    if args.step_scoring == "grouped":
        tuning = None
        if args.score_tuning:                       # the step's shapes: micro x L query rows, score_group x L per group
            default = GroupedTuning.for_shape(micro * p["L"], p["K"], p["d_model"], args.score_group * p["L"])
            tuning = dataclasses.replace(default, **json.loads(args.score_tuning))
        scoring = WeaverScoring(kernels=not args.torch_scores, group_rows=args.score_group, tuning=tuning)
    obj = WeaverObjective(initial_weaver(wcfg, 0), embed, lm_head, kind=args.loss, weights=depth_weights(p["L"], None),
                          scoring=scoring)
    if args.compile:
        obj.forward = torch.compile(obj.forward, mode=args.compile_mode)
    opt = make_optimizer(list(obj.parameters()), lr=3e-4, weight_decay=0.01, grad_clip=1.0,      # as the trainer
                         zero_stage=args.zero_stage, device=device)
    # the trainer's DeepSpeed config (one micro batch per step, gradient clipping 1.0)
    ds_cfg = TrainConfig(data=["synthetic rows"], output_dir="-", micro_batch=micro, grad_clip=1.0,
                         zero_stage=args.zero_stage).deepspeed_config(world, bf16=cuda)
    engine, _, _, _ = deepspeed.initialize(model=obj, optimizer=opt, config=ds_cfg, dist_init_required=False)
    pool = [synthetic_rows(args.global_batch, p, seed=s, device=device, candidates=args.candidates)
            for s in range(4)]
    for b in pool:
        for name in ("h_final", "dflash_hidden", "cand_logits"):
            b[name] = b[name].to(dtype)

    losses, times = [], []
    for step in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step_once(engine, pool[step % len(pool)], rank, micro)
        _sync(device)
        dt = time.perf_counter() - t0
        total = loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / world)
        if step >= args.warmup:
            times.append(dt)
    syncs = sync_sites(lambda: step_once(engine, pool[0], rank, micro)) if args.sync_debug and cuda else None
    # back to back, as the trainer runs them (it reads a step's loss and gradient norm one step late): no host
    # sync between steps, so the host prepares the next step while the GPU runs this one. The host seconds per
    # call show what waits: near the step time, the host is what the GPU waits for
    _sync(device)
    host = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    t0 = time.perf_counter()
    for step in range(args.steps):
        step_once(engine, pool[step % len(pool)], rank, micro, host)
    _sync(device)
    steady_s = (time.perf_counter() - t0) / args.steps
    host_ms = {k: v / args.steps * 1e3 for k, v in host.items()}
    profile_summary = None
    if args.profile and cuda and rank == 0:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for step in range(3):
                step_once(engine, pool[step % len(pool)], rank, micro)
            _sync(device)
            wall = (time.perf_counter() - t0) / 3
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
        profile_summary = dict(kernel_breakdown(prof, steps=3), wall_ms_per_step_profiled=wall * 1e3)
        print(json.dumps(profile_summary, indent=1))
        if args.trace:
            prof.export_chrome_trace(args.trace)
    times.sort()
    step_s = times[len(times) // 2]
    flops = flops_per_row(wcfg) * args.global_batch / step_s / 1e12                     # all ranks together
    peak = matmul_peak_tflops(device, dtype)                                         # bf16 on GPU, fp32 on CPU
    peak_mem = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    # where the step goes: the candidate scoring alone, on this rank's rows (GPU only)
    score = (score_time_ms(pool[0]["cand_ids"][:micro], p, lm_head, args.torch_scores, args.score_group)
             if cuda else None)
    result = {"env": env(), "preset": args.preset, "weaver_params": sum(q.numel() for q in obj.weaver.parameters()),
              "world_size": world, "global_batch": args.global_batch, "micro_batch_per_rank": micro,
              "zero_stage": args.zero_stage, "precision": "bf16" if cuda else "fp32", "candidate_scores": scores,
              "candidates": args.candidates, "step_scoring": args.step_scoring, "score_tuning": args.score_tuning,
              "compiled": args.compile,
              "compile_mode": args.compile_mode if args.compile else None,
              "median_step_s": step_s, "samples_per_s": args.global_batch / step_s,
              "achieved_tflops": flops, "matmul_peak_tflops_per_gpu": peak, "mfu": flops / (peak * world),
              "reference_peak_tflops_per_gpu": args.reference_peak_tflops,
              "mfu_vs_reference_peak": flops / (args.reference_peak_tflops * world),
              "steady_step_s": steady_s, "steady_samples_per_s": args.global_batch / steady_s,
              "steady_mfu": flops * step_s / steady_s / (peak * world), "steady_host_ms_per_step": host_ms,
              "host_sync_sites": syncs,
              "flops_per_sample": flops_per_row(wcfg), "candidate_scoring_fwd_bwd": score,
              "candidate_scoring_share_of_step": score["ms"] / (step_s * 1e3) if score else None, "loss_trace": losses,
              "peak_memory_gib": peak_mem, "profile": profile_summary}
    if rank == 0:
        share = f"{result['candidate_scoring_share_of_step']:.0%}" if score else "-"
        print(f"{'preset':<12}{'gpus':>5}{'batch':>7}{'step ms':>9}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}"
              f"{'scoring':>8}{'steady ms':>10}{'MFU':>7}")
        print(f"{args.preset:<12}{world:>5}{args.global_batch:>7}{step_s * 1e3:>9.2f}{result['samples_per_s']:>11.1f}"
              f"{flops:>9.1f}{result['mfu']:>7.1%}{share:>8}{steady_s * 1e3:>10.2f}{result['steady_mfu']:>7.1%}")
        print("host ms per back-to-back step: " + ", ".join(f"{k} {v:.2f}" for k, v in host_ms.items()))
        print(f"MFU {result['mfu']:.1%} against this machine's measured matmul rate ({peak:.0f} TFLOP/s per GPU), "
              f"{result['mfu_vs_reference_peak']:.1%} against the reference {args.reference_peak_tflops:.0f}")
        if args.out:
            write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
