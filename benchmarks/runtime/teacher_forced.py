"""Weaver against DFlash's marginals along the target's own continuations, teacher-forced: where each proposes well.

    python -m benchmarks.runtime.teacher_forced --out benchmarks/results/teacher_forced_cpu.json --limit 16
    python -m benchmarks.runtime.teacher_forced --world tiny --limit 2          # random tiny world: plumbing only

For every position j of each prompt's continuation (greedy at T = 0, one sample at T = 1, as the acceptance
benchmark's walks) and every depth d = 1..L, with the true tokens before it: DFlash's top-K candidates of depth d,
DFlash's marginal over them (softmax of its logits) and the Weaver's log q over them given the true path
(`Weaver.forward_chain`, the teacher-forced pass it is trained with). Per depth: the candidate hit rate (the target's
token among the K), how often the target's token is each proposer's first or among its first 4 (of all positions),
and the mean log-probability each gives the target's token where it is a candidate. A tree holds the first few
candidates of each node it expands, so the top-1 / top-4 rates are what its acceptance rests on.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm.auto import tqdm

from benchmarks.common import env, write_results
from benchmarks.runtime.acceptance import add_world_arguments, chat_ids, datasets, load_world
from tfm_runtime.acceptance import continuations, trajectory

TOPS = (1, 4)


class DepthStats:
    """Sums per depth [L] over positions: hits, top-k of each proposer, log-probability of the target's token."""

    def __init__(self, L: int):
        z = lambda: torch.zeros(L, dtype=torch.float64)  # noqa: E731
        self.n, self.hit = 0, z()
        self.top = {(who, k): z() for who in ("dflash", "weaver") for k in TOPS}
        self.logp = {who: z() for who in ("dflash", "weaver")}

    def add(self, truth, cand_ids, logp_dflash, logq_weaver) -> None:
        """truth [n, L]; cand_ids [n, L, K]; log-probabilities over the candidates [n, L, K] each."""
        hit = cand_ids == truth[..., None]                                                 # [n, L, K]
        self.n += truth.shape[0]
        self.hit += hit.any(-1).double().sum(0)
        for who, lp in (("dflash", logp_dflash), ("weaver", logq_weaver)):
            rank = lp.argsort(dim=-1, descending=True, stable=True)                          # [n, L, K]
            in_top = hit.gather(-1, rank)                                                  # [n, L, K] by rank
            for k in TOPS:
                self.top[who, k] += in_top[..., :k].any(-1).double().sum(0)
            self.logp[who] += (lp.double() * hit).sum(-1).sum(0)                           # 0 where no hit

    def row(self) -> dict:
        hits = self.hit.clamp(min=1)
        out = {"positions": self.n, "hit_rate": (self.hit / max(1, self.n)).tolist()}
        for (who, k), v in self.top.items():
            out[f"{who}_top{k}"] = (v / max(1, self.n)).tolist()
        for who, v in self.logp.items():
            out[f"{who}_logp_when_hit"] = (v / hits).tolist()
        return {k: [round(x, 4) for x in v] if isinstance(v, list) else v for k, v in out.items()}


def run(args) -> dict:
    target, drafter, weavers, tok, world = load_world(args)
    (name, weaver), = weavers.items()
    L, K = drafter.cfg.block_size - 1, weaver.cfg.candidate_pool
    embed, head = target.embed_weight, target.lm_head_weight
    rows = []
    for dataset, records in datasets(args).items():
        records = records[:args.limit] if args.limit else records
        for temperature in args.temperatures:
            stats = DepthStats(L)
            ids = [chat_ids(tok, r) for r in records]
            conts = continuations(target, ids, args.max_new_tokens + L, batch=args.group, temperature=temperature,
                                  seed=args.seed)
            for p, c in tqdm(list(zip(ids, conts)), desc=f"{dataset} T={temperature:g}", disable=args.no_progress):
                traj = trajectory(target, drafter, p, args.max_new_tokens, c)
                y = torch.tensor(traj.tokens, device=traj.draft_logits.device)
                n = traj.draft_logits.shape[0]
                truth = torch.stack([y[j + 1:j + 1 + L] for j in range(n)])                  # [n, L]
                chain = torch.stack([y[j:j + L] for j in range(n)])                          # [n, L] root, x_1..
                for lo in range(0, n, args.chunk):                # the scoring gathers [chunk, L, K, d_model]
                    sl = slice(lo, lo + args.chunk)
                    cand_logits, cand_ids = traj.draft_logits[sl].topk(min(K, traj.draft_logits.shape[-1]), dim=-1)
                    logq = weaver.forward_chain(traj.h_last[sl], traj.draft_hidden[sl], chain[sl], cand_ids,
                                                cand_logits, embed, head)                     # [chunk, L, K]
                    stats.add(truth[sl], cand_ids, cand_logits.float().log_softmax(-1), logq.float())
            rows.append({"dataset": dataset, "temperature": temperature, "adapter": name, "prompts": len(records),
                         **stats.row()})
    return {"world": world, "max_new_tokens": args.max_new_tokens, "candidate_pool": K, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runtime.teacher_forced", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(ap)
    ap.set_defaults(datasets=["mtbench"])
    ap.add_argument("--limit", type=int, default=16, help="first N prompts of each dataset (0: all)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--chunk", type=int, default=16, help="positions scored together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.adapter and len(args.adapter) > 1:
        ap.error("one --adapter at a time")
    t0 = time.time()
    with torch.no_grad():
        result = run(args)
    result["seconds"] = round(time.time() - t0, 1)
    if args.out:
        write_results(args.out, {"env": env(), **result})
    for r in result["rows"]:
        print(f"{r['dataset']} T={r['temperature']:g} ({r['prompts']} prompts, {r['positions']} positions), "
              "depth 1 / 4 / 15:")
        for key in ("hit_rate", "dflash_top1", "weaver_top1", "dflash_top4", "weaver_top4",
                    "dflash_logp_when_hit", "weaver_logp_when_hit"):
            v = r[key]
            print(f"  {key:22s} {v[0]:8.4f} {v[min(3, len(v) - 1)]:8.4f} {v[-1]:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
