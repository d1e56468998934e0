"""Weaver tree shape: acceptance length against tree-build time as the expansion width (and the children per node)
grow.

The best-first Weaver build places `width` frontier entries per Weaver step, by default ceil(budget / 16) (the
authors' choice: about 16 sequential steps per tree), and each expanded node offers its `expand` best children (8 by
default: a tree has at most 8 nodes at depth 1). The shape-static build's time grows with its step count (each
step is a fixed sequence of small launches), while a wider step ranks more nodes by a frontier that has not yet seen
its siblings' children. This measures both sides at each budget, step count S (width = ceil(budget / S)) and
`--expands` value:

- mean acceptance length at `--temperature` 0 (tokens per verify step, bonus included, mean over requests) along the
  target's greedy continuations, or at 1 along one sample of them per prompt (target-only verification), walked
  exactly as `benchmarks.runtime.acceptance` does (tfm_runtime.acceptance.walk), on the first `--limit` prompts of
  each dataset;
- on CUDA, one shape-static build (batch 1, captured in CUDA graphs, input copies included) in median ms, on the
  DFlash inputs of the first prompt's first step.

    python -m benchmarks.runtime.weaver_width --prompts-dir .carry/prompts --limit 16 --out F.json
    python -m benchmarks.runtime.weaver_width --world tiny --limit 2 --budgets 8 --steps 4 2   # plumbing only
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm.auto import tqdm

from benchmarks.common import env, write_results
from benchmarks.runtime.acceptance import Tally, add_world_arguments, chat_ids, datasets, load_world
from benchmarks.runtime.runtime_bench import median_ms
from tfm_runtime.acceptance import StaticWalkTrees, continuations, trajectory, walk
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.weaver_tree import step_width


def widths(budgets: list[int], steps: list[int]) -> list[tuple[int, int, int]]:
    """(budget, steps, width) for every pair, widths deduplicated per budget (the first step count that gives it)."""
    out = []
    for b in budgets:
        seen = set()
        for s in steps:
            w = step_width(b, s)
            if w not in seen:
                seen.add(w)
                out.append((b, s, w))
    return out


def build_ms(decoder, traj, K: int, reps: int) -> dict:
    """The shape-static build of one tree from the trajectory's first step: rounds and median ms (CUDA graph)."""
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder
    w, tgt = decoder.adapter, decoder.target
    cand_logits, cand_ids = traj.draft_logits[:1].topk(K, dim=-1)                       # [1, L, K]
    dev = cand_ids.device
    inputs = (torch.tensor(traj.tokens[:1], device=dev), traj.h_last[:1], traj.draft_hidden[:1], cand_ids,
              cand_logits)
    b = StaticWeaverTreeBuilder(w, tgt.embed_weight, tgt.lm_head_weight, decoder.tree_budget, K=K,
                                L=cand_ids.shape[1], batch=1, expand=decoder.expand, width=decoder.width)
    res = {"rounds": b.rounds, "first_rounds": b.first_rounds}
    if dev.type == "cuda":
        b.capture(*inputs)
        res["build_ms"] = round(median_ms(lambda: b.build(*inputs), dev, reps), 4)
    return res


def run(args, save=None) -> dict:
    target, drafter, weavers, tok, world = load_world(args)
    if len(weavers) != 1:
        raise SystemExit("weaver_width needs exactly one Weaver (--adapter)")
    [(adapter, weaver)] = weavers.items()
    L = drafter.cfg.block_size - 1
    K = min(weaver.cfg.candidate_pool, target.vocab_size)
    eos, n, t = tok.eos_token_id, args.max_new_tokens, args.temperature
    cuda = target.device.type == "cuda"
    grid = [(b, s, w, e) for b, s, w in widths(args.budgets, args.steps) for e in args.expands]
    decoders = {(b, w, e): SpeculativeDecoder(target, drafter, weaver, tree_budget=b, proposal="weaver",
                                              verification="target_only", width=w, expand=e) for b, _, w, e in grid}
    statics = {}
    result = {"world": world, "adapter": adapter, "max_new_tokens": n, "candidate_pool": K, "temperature": t,
              "rows": [], "builds": []}
    for name, records in datasets(args).items():
        records = records[:args.limit] if args.limit else records
        tallies = {(b, w, e): Tally(L) for b, _, w, e in grid}
        for lo in tqdm(range(0, len(records), args.group), desc=name, disable=args.no_progress):
            ids = [chat_ids(tok, rec) for rec in records[lo:lo + args.group]]
            # prompt i's sample is seeded args.seed + i, as in the acceptance benchmark
            conts = continuations(target, ids, n + L, batch=args.group, temperature=t, seed=args.seed + lo)
            trajs = [trajectory(target, drafter, p, n, c) for p, c in zip(ids, conts)]
            if not result["builds"]:
                for b, s, w, e in grid:
                    result["builds"].append({"budget": b, "steps": s, "width": w, "expand": e,
                                             **build_ms(decoders[b, w, e], trajs[0], K, args.reps)})
            for key, tally in tallies.items():
                if cuda and key not in statics:
                    statics[key] = StaticWalkTrees(decoders[key], batch=args.group, K=K, L=L)
                for accepted, sizes in walk(decoders[key], trajs, n, eos, statics.get(key), temperature=t):
                    tally.add(accepted, sizes)
        for b, s, w, e in grid:
            result["rows"].append(tallies[b, w, e].row(dataset=name, temperature=t, budget=b, steps=s, width=w,
                                                       expand=e))
        if save:
            save(result)
    return result


def table(result: dict) -> str:
    key = lambda r: (r["budget"], r["width"], r.get("expand", 8))  # noqa: E731
    builds = {key(r): r for r in result["builds"]}
    sets = sorted({r["dataset"] for r in result["rows"]})
    lines = ["| budget | width | expand | rounds | build ms | " + " | ".join(sets) + " |",
             "|---" * (5 + len(sets)) + "|"]
    for b, w, e in sorted({key(r) for r in result["rows"]}):
        acc = {r["dataset"]: r["acceptance_length"] for r in result["rows"] if key(r) == (b, w, e)}
        info = builds.get((b, w, e), {})
        ms = info.get("build_ms")
        lines.append(f"| {b} | {w} | {e} | {info.get('first_rounds', '')} | {'' if ms is None else f'{ms:.3f}'} | "
                     + " | ".join(f"{acc[s]:.3f}" for s in sets) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runtime.weaver_width", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(ap)                                    # one Weaver: --adapter at most once
    ap.add_argument("--limit", type=int, default=16, help="first N prompts of each dataset (0: all)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 8, 4],
                    help="Weaver steps per tree; width = ceil(budget / steps) (16: the default width)")
    ap.add_argument("--expands", type=int, nargs="+", default=[8], help="children offered per expanded node")
    ap.add_argument("--temperature", type=float, default=0.0, choices=[0.0, 1.0],
                    help="0: greedy continuations; 1: one sample per prompt, target-only verification")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--group", type=int, help="requests walked in lockstep (default: 16 on CUDA, 2 on the CPU)")
    ap.add_argument("--reps", type=int, default=20, help="timed builds per width (CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", help="results JSON (rewritten after each dataset)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.group = args.group or (16 if args.device.startswith("cuda") else 2)
    if min(args.budgets + args.steps + args.expands) < 1:
        ap.error("budgets, steps and expands must be >= 1")
    t0 = time.time()

    def save(result):
        result["seconds"] = round(time.time() - t0, 1)
        if args.out:
            write_results(args.out, {"env": env(), **result})

    with torch.no_grad():
        result = run(args, save)
    save(result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
