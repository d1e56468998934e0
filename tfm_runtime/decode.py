"""python -m tfm_runtime.decode --adapter RUN/final --prompt "Explain recursion."

Decode chat prompts with a trained Weaver adapter (a local folder or a Hub id). The target and the DFlash drafter
are the ones the adapter's contract names (`--target` / `--drafter` give other copies, e.g. a local folder of the
same model); the contract is checked against them. Prints each answer and the decoding statistics (acceptance
length: tokens per verify step, bonus included). `--check` also decodes with the target alone and fails unless
the speculative output is token for token the same (greedy, temperature 0).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from tfm_runtime.loading import DTYPES


def build(adapter: str, *, target: str | None = None, drafter: str | None = None, dtype=None, device="cpu",
          revision: str | None = None):
    """-> (target TargetModel, drafter, adapter, tokenizer), the contract checked."""
    from tfm_runtime.hub import check_adapter, load_adapter
    from tfm_runtime.loading import ModelSpec, load_drafter, load_target, load_tokenizer
    weaver = load_adapter(adapter, revision, device=device)
    c = weaver.contract
    # a --target / --drafter is a copy of the contract's model: it carries the contract's id (sizes and the
    # tokenizer hash are still checked)
    dspec = ModelSpec(drafter, id=c.drafter_id) if drafter else ModelSpec(c.drafter_id, c.drafter_revision)
    tspec = ModelSpec(target, id=c.target_id) if target else ModelSpec(c.target_id, c.target_revision)
    drafter_m = load_drafter(dspec, device, dtype)
    target_m = load_target(tspec, drafter_m.cfg.target_layer_ids, device, dtype)
    check_adapter(c, weaver, target=target_m, drafter=drafter_m, where=f"adapter {adapter}")
    return target_m, drafter_m, weaver.to(target_m.dtype), load_tokenizer(tspec)


def greedy(target, ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The target's own greedy continuation (the reference a lossless decoder must reproduce at T = 0)."""
    out = target.model.generate(torch.tensor([ids], device=target.device), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tfm_runtime.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", required=True, help="Weaver folder (e.g. a train run's final/) or Hub id")
    ap.add_argument("--revision", help="Hub revision of the adapter")
    ap.add_argument("--target", help="target spec (default: the contract's target_id)")
    ap.add_argument("--drafter", help="DFlash drafter spec (default: the contract's drafter_id)")
    ap.add_argument("--prompt", action="append", required=True, help="a user message (repeat for several)")
    ap.add_argument("--proposal", choices=["weaver", "ddtree", "chain"], default="weaver")
    ap.add_argument("--budget", type=int, default=16, help="tree budget: nodes drafted per verify step")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check", action="store_true", help="greedy only: compare with the target's own decode")
    args = ap.parse_args(argv)
    if args.check and args.temperature != 0:
        ap.error("--check compares greedy outputs: use --temperature 0")
    from tfm_runtime.engine import SpeculativeDecoder
    try:
        target, drafter, weaver, tok = build(args.adapter, target=args.target, drafter=args.drafter,
                                             dtype=DTYPES.get(args.dtype), device=args.device, revision=args.revision)
        dec = SpeculativeDecoder(target, drafter, weaver if args.proposal == "weaver" else None,
                                 tree_budget=args.budget, proposal=args.proposal)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = True
    for text in args.prompt:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        g = torch.Generator(device=target.device).manual_seed(args.seed)
        out = dec.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           eos_token_id=tok.eos_token_id, generator=g)
        print(f"> {text}\n{tok.decode(out.tokens, skip_special_tokens=True)}")
        print(json.dumps(out.stats.summary()))
        if args.check:
            same = out.tokens == greedy(target, ids, args.max_new_tokens, tok.eos_token_id)
            ok &= same
            print(f"lossless: {'identical to the target decoding alone' if same else 'DIFFERENT from the target'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
