"""A/B of the fast runtime's step costs: this checkout against another (an earlier revision), on one GPU, alternating.

    git worktree add /tmp/base <rev>   # or: git archive <rev> tfm_runtime tfm_kernels | tar -x -C /tmp/base
    python -m benchmarks.runtime.step_ab --base /tmp/base --base-rev <rev> --out benchmarks/results/step_ab_h100.json
    python -m benchmarks.runtime.step_ab --base /tmp/base --also main=/tmp/main ...   # more codes in the same turns

Each code runs in its own process (its `tfm_runtime` and `tfm_kernels` first on PYTHONPATH), `--runs` times in turn,
and measures with CUDA graphs, bf16, batch 1: the AR decode step and the verify of a 65-node tree of a random
SmolLM2-135M-shaped target (`GraphedTarget`, 128 committed tokens), the captured ancestor masks of a 65-node tree
(`ancestor_masks`, as FastDecoder replays them after each build), the captured first phase of the Weaver tree
build at budget 64 and widths 4 / 8 / 16 (`StaticWeaverTreeBuilder`, a random Weaver in the SmolLM2 recipe's shape,
K = 512 candidates at 15 depths), and whole `FastDecoder` steps with that Weaver at width 8 and a random DFlash
drafter in the committed one's shape (`weaver64_w8_step_ms`: draft, build, verify and commit with the host's part,
about one token per step). Random weights: the costs depend on the shapes only. The table ends with each
figure's median per code and the ratio of this checkout's to the base's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CONFIG = os.path.join(REPO, "benchmarks", "data", "smollm2_135m_config.json")
WIDTHS = (4, 8, 16)


def measure(tag: str, reps: int, device: str) -> dict:
    """The step costs of the code importable here (run in a child process)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tfm_runtime
    from tfm_runtime.fast.dense import DenseModel
    from tfm_runtime.fast.graphs import GraphedTarget
    from tfm_runtime.fast.graphs import capture
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, ancestor_masks
    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    cuda = device == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32

    def timed(fn, n):
        for _ in range(min(20, n)):
            fn()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    with open(CONFIG) as f:
        cfg = LlamaConfig.from_dict(json.load(f))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to(device, dt).eval()
    model = DenseModel.from_hf(hf, max_seq_len=1024)
    graphed = GraphedTarget(model, (65,))
    row = {"code": tag, "tfm_runtime": os.path.dirname(os.path.dirname(tfm_runtime.__file__))}
    with torch.no_grad():
        model.prefill(torch.randint(0, cfg.vocab_size, (128,), device=device))
        tok, pos = torch.tensor([5], device=device), torch.tensor([128], device=device)
        row["ar_ms"] = timed(lambda: graphed.decode(tok, pos), reps)
        N = 65                                                   # a root and 64 children
        tokens = torch.randint(0, cfg.vocab_size, (N,), device=device)
        depths = torch.ones(N, dtype=torch.long, device=device)
        depths[0] = 0
        anc = torch.eye(N, dtype=torch.bool, device=device)
        anc[:, 0] = True
        start = torch.tensor([128], device=device)
        row["verify65_ms"] = timed(lambda: graphed.verify_tree(tokens, depths, anc, start), reps)
        parents = torch.tensor([-1] + [int(torch.randint(max(0, i - 4), i, (1,))) for i in range(1, N)],
                               device=device)[None]                                           # [1, 65]
        if cuda:                                                 # as FastDecoder replays it after each build
            graph, _ = capture(lambda: ancestor_masks(parents, 15))
            row["anc65_ms"] = timed(graph.replay, reps)
        torch.manual_seed(0)
        weaver = Weaver(WeaverConfig(d_model=576, d_embed=576, d_rank=256, num_layers=2, num_heads=4, mlp_dim=768,
                                     lookahead=15, candidate_pool=512)).to(device, dt).eval()
        V, H, L, K = cfg.vocab_size, cfg.hidden_size, 15, 512
        g = torch.Generator().manual_seed(0)
        roots = torch.randint(0, V, (1,), generator=g).to(device)
        h, u = torch.randn(1, H, generator=g).to(device, dt), torch.randn(1, L, H, generator=g).to(device, dt)
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(L)])[None].to(device)
        logits = torch.randn(1, L, K, generator=g).sort(-1, descending=True).values.to(device, torch.float32)
        args = (roots, h, u, ids, logits)
        for width in WIDTHS:
            b = StaticWeaverTreeBuilder(weaver, model.embed, model.embed, 64, K=K, L=L, batch=1, width=width)
            if cuda:
                b.capture(*args)
            row[f"build64_w{width}_ms"] = timed(lambda: b.build(*args, finish=False), min(reps, 200))
        # whole FastDecoder steps as the decoder runs them, host included: draft, the Weaver(64) build at width 8,
        # verify, commit (greedy; random weights, so about one token per step)
        from tfm_runtime.fast.decoder import FastDecoder
        from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
        from tfm_runtime.models.target import TargetModel
        with open(os.path.join(REPO, "assets", "smollm2-135m-instruct", "dflash-b16", "config.json")) as f:
            torch.manual_seed(1)
            drafter = DFlashDrafter(DFlashConfig.from_hf_dict(json.load(f))).to(device, dt).eval()
        dec = FastDecoder(TargetModel(hf, drafter.cfg.target_layer_ids), drafter, weaver, tree_budget=64, width=8,
                          cuda_graphs=cuda, max_seq_len=1024)
        prompt = torch.randint(0, V, (128,), generator=g)
        dec.generate(prompt, max_new_tokens=16)                  # captures the graphs
        out = dec.generate(prompt, max_new_tokens=min(reps, 256) if cuda else 4)
        row["weaver64_w8_step_ms"] = 1e3 * out.stats.seconds["step"] / out.stats.verify_steps
    return row


def run_child(tag: str, code_dir: str, reps: int, device: str) -> dict:
    path = os.pathsep.join([code_dir, REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, HERE, "--measure", tag, "--reps", str(reps), "--device", device],
                         env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if out.returncode:                            # recorded; the other codes' runs go on
        return {"code": tag, "error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="a checkout of the code to compare with (its tfm_runtime/ and tfm_kernels/)")
    ap.add_argument("--base-rev", help="the base's git revision, for the results file (default: read from --base)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout measured in the same turns (repeatable); its ratios are against the base")
    ap.add_argument("--runs", type=int, default=2, help="alternating runs of each code")
    ap.add_argument("--reps", type=int, default=300, help="timed calls per figure")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--measure", metavar="TAG", help=argparse.SUPPRESS)      # the child process
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.reps, args.device)))
        return
    if not args.base:
        ap.error("--base is required")
    sys.path.insert(0, REPO)
    from benchmarks.common import env, write_results
    codes = [("base", os.path.abspath(args.base))]
    for item in args.also:
        name, sep, folder = item.partition("=")
        if not sep or not name or name in ("base", "head") or not os.path.isdir(folder):
            ap.error(f"--also takes NAME=DIR with an existing DIR and a NAME other than base / head, got {item!r}")
        codes.append((name, os.path.abspath(folder)))
    codes.append(("head", REPO))
    rows = []
    for _ in range(args.runs):
        for tag, code in codes:
            rows.append(run_child(tag, code, args.reps, args.device))
            print(json.dumps(rows[-1]), flush=True)
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"the {r['code']} run failed:\n{r['error']}", file=sys.stderr)
    rows = [r for r in rows if "error" not in r]
    tags = [tag for tag, _ in codes if any(r["code"] == tag for r in rows)]
    if "base" not in tags or "head" not in tags:
        sys.exit("step_ab: no run of the base or of this checkout finished")
    keys = [k for k in rows[0] if k.endswith("_ms") and all(k in r for r in rows)]
    median = {tag: {k: round(statistics.median(r[k] for r in rows if r["code"] == tag), 4) for k in keys}
              for tag in tags}
    ratios = {tag: {k: round(median[tag][k] / median["base"][k], 3) for k in keys} for tag in tags[1:]}
    rev = args.base_rev or subprocess.run(["git", "-C", args.base, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip() or None
    print(f"{'figure':<18}" + "".join(f"{t + ' ms':>12}" for t in tags)
          + "".join(f"{t + '/base':>13}" for t in tags[1:]))
    for k in keys:
        print(f"{k:<18}" + "".join(f"{median[t][k]:>12.3f}" for t in tags)
              + "".join(f"{ratios[t][k]:>13.3f}" for t in tags[1:]))
    if args.out:
        write_results(args.out, {"env": env(), "base_revision": rev, "also": dict(codes[1:-1]), "rows": rows,
                                 "failed_runs": [{"code": r["code"], "error": r["error"][-500:]} for r in errors],
                                 "median": median, "head_over_base": ratios["head"],
                                 **({"over_base": ratios} if len(tags) > 2 else {})})


if __name__ == "__main__":
    main()
