"""Mean acceptance length of chain / DDTree / Weaver trees on a world, at several budgets and temperatures.

    python -m benchmarks.acceptance --family llama --budgets 16 32 64 --temperatures 0 1 --out results.json

Worlds: the tiny random worlds of tfm_runtime.worlds (any machine, seconds). Acceptance length does not depend
on hardware, so this runs anywhere; with random weights the numbers only check the plumbing.
"""
from __future__ import annotations

import argparse
import platform

import torch

from pipelines.provenance import git_revision
from tfm_runtime.acceptance import estimate_acceptance, format_table
from tfm_runtime.io import atomic_write_json
from tfm_runtime.worlds import FAMILIES, tiny_world


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=FAMILIES, default="llama", help="tiny world family (default: llama)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    w = tiny_world(args.family, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, w.contract.vocab_size - 1, (8,), generator=g).tolist() for _ in range(args.prompts)]
    rows = estimate_acceptance(w.target, w.drafter, w.weaver, prompts, budgets=args.budgets,
                               temperatures=args.temperatures, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"world: tiny {args.family} (random weights), {len(prompts)} prompts x {args.max_new_tokens} new tokens")
    print(format_table(rows))
    if args.out:
        atomic_write_json(args.out, {"world": f"tiny-{args.family}-seed{args.seed}", "revision": git_revision(),
                                     "host": platform.node(), "rows": [r.__dict__ for r in rows]})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
