"""Decoding step costs at the Qwen3.6-27B shape (random weights) and the speedup they project with measured acceptance.

    python -m benchmarks.runtime.shape27b_bench --out benchmarks/results/runtime_27b_h200.json   # H200, bf16, ~3 min
    python -m benchmarks.runtime.shape27b_bench --smoke                                           # tiny shape, CPU

Target: a Qwen3.5 text hybrid in the Qwen3.6-27B shape (64 layers, every fourth full attention and the others Gated
DeltaNet, hidden 5120, vocab 248320; `SHAPE`), random bf16 weights, on the fast hybrid backend (`HybridModel`, GDN
through the Triton tree kernels). Drafter: DFlash in its published 27B shape (5 layers, block 16; `DRAFTER`), run by
`StaticDFlash` with CUDA graphs. Weaver: `WeaverConfig.qwen36_27b()`, trees built by `StaticWeaverTreeBuilder`
(captured). Batch 1, a 128-token prompt.

Rows: the AR step (`HybridModel.decode` replayed from a CUDA graph by `GraphedTarget`; `eager_ms` without) against
the weight-streaming floor of the GPU (every weight but the input embedding at the read bandwidth measured in the
run, `read_bandwidth`; 12.66 ms on the H200 by an earlier measurement; `--floor-ms` sets it); per budget
16/32/64/128: the tree verify of the Weaver's tree (`verify_ms`) and its ratio to the AR step, the DFlash draft, the
Weaver tree build (in 16 steps; `build_ms_by_steps`: at each `--steps`) and the commit of a 4-node path (verify and
the GDN state commit replayed from the graphs of each budget's tree size), each a median of `--reps`; the projected tokens/s and speedup over AR with the mean acceptance
length of Weaver trees at that budget from `--acceptance` (the SmolLM2 figures of benchmarks/results/acceptance.json,
T = 0, mean over its datasets: a stand-in until a 27B Weaver exists).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.common import env, write_results
from benchmarks.runtime.runtime_bench import median_ms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
             num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=1e7)
DRAFTER = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, block_size=16)
SMOKE_SHAPE = dict(SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
SMOKE_DRAFTER = dict(DRAFTER, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)


def target_model(shape: dict, dev, dtype, max_seq_len: int):
    """A random Qwen3.5 text model of `shape` built on the device, as HybridModel (weights shared)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from tfm_runtime.fast.hybrid import HybridModel
    shape = dict(shape)
    every = shape.pop("full_attention_interval")
    partial, theta = shape.pop("partial_rotary_factor"), shape.pop("rope_theta")
    n = shape["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    cfg = Qwen3_5TextConfig(**shape, layer_types=types, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": theta,
                                             "partial_rotary_factor": partial})
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    taps = [1, n // 4, n // 2, 3 * n // 4, n - 2][: max(1, min(5, n - 1))]
    streamed = sum(p.numel() * p.element_size() for name, p in hf.named_parameters()
                   if not name.endswith("embed_tokens.weight"))        # a step reads one embedding row, every weight
    return HybridModel.from_hf(hf, taps, max_seq_len=max_seq_len), types, streamed


def read_bandwidth(dev, reps: int) -> float:
    """Bytes per ms this GPU reads: the median of reductions over a 4 GiB buffer (every byte read, almost nothing
    written). The weight-streaming floor of an AR step is its weight bytes at this rate."""
    buf = torch.ones(1 << 31, dtype=torch.bfloat16, device=dev)                    # 4 GiB
    ms = warm_median_ms(lambda: torch.amax(buf), dev, reps)
    return (1 << 32) / ms                                   # the buffer is freed on return, before the model


def drafter_model(shape: dict, target_cfg, taps, dev, dtype):
    from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
    cfg = DFlashConfig(**shape, vocab_size=target_cfg.vocab_size, num_target_layers=target_cfg.num_layers,
                       target_layer_ids=list(taps), mask_token_id=target_cfg.vocab_size - 1)
    return DFlashDrafter(cfg).to(device=dev, dtype=dtype).eval()


def warm_median_ms(fn, dev, reps: int) -> float:
    """runtime_bench.median_ms after two untimed calls (Triton compilation, allocator)."""
    fn(), fn()
    return median_ms(fn, dev, reps)


def weaver_acceptance(path: str) -> dict[int, float]:
    """Budget -> mean acceptance length of Weaver trees at T = 0 over the datasets of an acceptance results file."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["temperature"] == 0 and r["proposal"] == "weaver":
            by.setdefault(r["budget"], []).append(r["acceptance_length"])
    return {b: statistics.mean(v) for b, v in by.items()}


@torch.no_grad()
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 8],
                    help="Weaver steps per tree (width ceil(budget / steps)); the first is the rows' build, each is "
                         "timed (`build_ms_by_steps`)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--floor-ms", type=float, help="the weight-streaming floor of one AR step on this GPU (default: "
                    "the AR step's weight bytes at this GPU's read bandwidth, measured here; none on the CPU)")
    ap.add_argument("--acceptance", default=os.path.join(ROOT, "benchmarks", "results", "acceptance.json"))
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (float32): the code path only")
    ap.add_argument("--out", help="results JSON")
    args = ap.parse_args(argv)
    from tfm_runtime.fast.dflash import StaticDFlash
    from tfm_runtime.fast.graphs import GraphedTarget
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, ancestor_masks
    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    from tfm_runtime.weaver_tree import step_width

    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    graphs = dev.type == "cuda"
    torch.manual_seed(0)
    run_env, t0 = env(), time.perf_counter()
    top = max(args.budgets)
    bandwidth = read_bandwidth(dev, args.reps) if dev.type == "cuda" else None      # measured before the model
    model, types, streamed = target_model(SMOKE_SHAPE if args.smoke else SHAPE, dev, dtype,
                                          args.prompt_tokens + 256 + top)
    floor = args.floor_ms or (streamed / bandwidth if bandwidth else None)
    c = model.cfg
    drafter = drafter_model(SMOKE_DRAFTER if args.smoke else DRAFTER, c, model.tap_layer_ids, dev, dtype)
    L = drafter.cfg.block_size - 1
    wcfg = WeaverConfig.qwen36_27b()
    if args.smoke:
        wcfg = WeaverConfig(d_model=c.hidden_size, d_embed=c.hidden_size, d_rank=32, num_layers=2, num_heads=2,
                            mlp_dim=64, lookahead=L, candidate_pool=16)
    weaver = Weaver(wcfg).to(device=dev, dtype=dtype).eval()
    K = min(wcfg.candidate_pool, c.vocab_size)

    # decode, verify at each budget's tree size and the GDN state commit as CUDA graphs (eager on the CPU); captured
    # before the prefill, which starts from empty GDN states
    runner = GraphedTarget(model, [b + 1 for b in args.budgets])
    prompt = torch.randint(0, c.vocab_size - 1, (args.prompt_tokens,), device=dev)
    out = model.prefill(prompt)
    start = args.prompt_tokens
    token = out.logits.argmax(-1)                                                     # [1]
    pos = torch.tensor([start], device=dev)

    ar_eager_ms = warm_median_ms(lambda: model.decode(token, pos), dev, args.reps)   # the same slot each time
    ar_ms = warm_median_ms(lambda: runner.decode(token, pos), dev, args.reps)
    dflash = StaticDFlash(drafter, model.embed, model.lm_head, model.max_seq_len, cuda_graphs=graphs)
    dflash.prefill(out.taps)
    draft_ms = warm_median_ms(lambda: dflash.draft(token), dev, args.reps)
    logits, hidden = dflash.draft(token)                                              # [L, V], [L, H]
    cand_logits, cand_ids = logits.float().topk(K, dim=-1)                            # [L, K]
    h_last = out.hidden[-1]
    accept = weaver_acceptance(args.acceptance) if os.path.exists(args.acceptance) else {}
    per_budget = []
    inputs = (token, h_last[None], hidden[None], cand_ids[None], cand_logits[None].to(dtype))
    for budget in args.budgets:
        by_steps = {}
        for steps in args.steps:
            b = StaticWeaverTreeBuilder(weaver, model.embed, model.lm_head, budget, K=K, L=L, batch=1, device=dev,
                                        dtype=dtype, width=step_width(budget, steps))
            if graphs:
                b.capture(*inputs)
            by_steps[str(steps)] = round(warm_median_ms(lambda b=b: b.build(*inputs), dev, args.reps), 3)
            if steps == args.steps[0]:
                trees = b.build(*inputs)                  # the verified tree: the first step count's
                n = int(trees.num_nodes[0])
                anc = ancestor_masks(trees.parents[:, :n], L)[0]
                tree = (trees.tokens[0, :n], trees.depths[0, :n], anc)
                parents = trees.parents[0, :n].tolist()
            del b
        build_ms = by_steps[str(args.steps[0])]
        verify_ms = warm_median_ms(lambda: runner.verify_tree(*tree, start), dev, args.reps)  # nothing committed
        path = [0]
        while len(path) < 4 and path[-1] in parents:                                  # a root path of <= 4 nodes
            path.append(parents.index(path[-1]))
        path = torch.tensor(path, device=dev)

        def commit():
            runner.verify_tree(*tree, start)
            runner.commit(start, path)
        commit_ms = max(0.0, warm_median_ms(commit, dev, args.reps) - verify_ms)
        step = draft_ms + build_ms + verify_ms + commit_ms
        tau = accept.get(budget)
        per_budget.append({"budget": budget, "nodes": n, "verify_ms": round(verify_ms, 3),
                           "verify_over_ar": round(verify_ms / ar_ms, 3), "tree_build_ms": round(build_ms, 3),
                           "build_ms_by_steps": by_steps,
                           "commit_ms": round(commit_ms, 3), "step_ms": round(step, 3),
                           "draft_and_build_over_verify": round((draft_ms + build_ms) / verify_ms, 3),
                           "acceptance_length": tau,
                           "projected_tokens_per_s": round(1e3 * tau / step, 1) if tau else None,
                           "projected_speedup_over_ar": round(tau * ar_ms / step, 3) if tau else None})
    result = {"env": run_env,
              "setup": {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
                        "target": {**(SMOKE_SHAPE if args.smoke else SHAPE),
                                   "gdn_layers": types.count("linear_attention"),
                                   "attention_layers": types.count("full_attention"), "gdn_backend": model.gdn},
                        "drafter": SMOKE_DRAFTER if args.smoke else DRAFTER, "weaver": wcfg.to_dict(),
                        "commit_path_nodes": "a root path of up to 4 nodes of each tree",
                        "prompt_tokens": args.prompt_tokens, "reps": args.reps, "cuda_graphs": graphs,
                        "acceptance_from": os.path.relpath(args.acceptance, ROOT) if accept else None},
              "ar": {"ms": round(ar_ms, 3), "eager_ms": round(ar_eager_ms, 3),
                     "floor_ms": round(floor, 3) if floor else None, "streamed_bytes": streamed,
                     "read_gb_per_s": round(bandwidth / 1e6, 1) if bandwidth else None,
                     "over_floor": round(ar_ms / floor, 3) if floor else None},
              "draft_ms": round(draft_ms, 3), "budgets": per_budget,
              "goals": {"ar_over_floor <= 1.15": ar_ms / floor <= 1.15 if floor else None,
                        "verify_65_over_ar <= 1.3": next((r["verify_over_ar"] <= 1.3 for r in per_budget
                                                          if r["budget"] == 64), None),
                        "draft_and_build_over_verify <= 0.1 (budget 64)": next(
                            (r["draft_and_build_over_verify"] <= 0.1 for r in per_budget if r["budget"] == 64), None),
                        "projected_speedup >= 4.37 (budget 64)": next(
                            (r["projected_speedup_over_ar"] >= 4.37 for r in per_budget if r["budget"] == 64
                             and r["projected_speedup_over_ar"]), None)},
              "total_s": round(time.perf_counter() - t0, 1)}
    if args.out:
        write_results(args.out, result)
    print(f"AR step {ar_ms:.2f} ms (eager {ar_eager_ms:.2f}, floor {floor} ms), draft {draft_ms:.2f} ms")
    print(f"{'budget':>7}{'nodes':>7}{'verify':>9}{'/AR':>7}{'build':>8}{'commit':>8}{'step':>8}{'tau':>7}{'x AR':>7}")
    for r in per_budget:
        print(f"{r['budget']:>7}{r['nodes']:>7}{r['verify_ms']:>9.2f}{r['verify_over_ar']:>7.2f}"
              f"{r['tree_build_ms']:>8.2f}{r['commit_ms']:>8.2f}{r['step_ms']:>8.2f}{r['acceptance_length'] or 0:>7.2f}"
              f"{r['projected_speedup_over_ar'] or 0:>7.2f}")
    return result


if __name__ == "__main__":
    main()
