"""Small building blocks shared by the drafter models: RMSNorm, rotary embedding, SwiGLU, safetensors I/O (with
checks that name a truncated or damaged file)."""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn


def kernel_device(t: torch.Tensor) -> bool:
    """Whether t lives where the runtime's Triton kernels run (CUDA): the one device test of every kernel path, so
    that `benchmarks.gpu.compile_check` takes those paths on the CPU by standing in for it alone."""
    return t.is_cuda


def inference_kernel_ok(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a forward-only Triton kernel may stand in for a few torch ops: x on CUDA in fp16 / bf16 / fp32 with
    every parameter in its dtype, no gradient wanted, and not traced by torch.compile (which fuses the ops itself)."""
    ps = [p for p in params if p is not None]
    return (kernel_device(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(p.dtype == x.dtype for p in ps) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in ps))))


def small_linear_ok(x: torch.Tensor, rows: int, weights: tuple[torch.Tensor, ...],
                    *others: torch.Tensor | None) -> bool:
    """Whether `tfm_kernels.small_linear` computes a layer (or a model's layers, weights being all of theirs): CUDA
    inference (`inference_kernel_ok` of x, the weights and the other tensors it reads) over rows and weights it is
    for (`small_linear_fits`)."""
    if not inference_kernel_ok(x, *weights, *others):
        return False
    from tfm_kernels.small_linear import small_linear_fits
    return small_linear_fits(rows, *weights)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (+ bias). Computed in fp32, returned in the input dtype; in CUDA inference one launch
    of `tfm_kernels.rms_norm` with the same roundings."""

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if inference_kernel_ok(x, self.weight, self.bias):
            from tfm_kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.bias, self.eps)
        dt = x.dtype
        xf = x.float() if dt in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dt)
        return y + self.bias if self.bias is not None else y

    def rows(self, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The norm of table[index] (an embedding lookup): table [V, D], index long [...] -> [..., D]; in CUDA
        inference one launch of `tfm_kernels.rms_norm.rms_norm_rows`, reading the rows in place."""
        if inference_kernel_ok(table, self.weight, self.bias):
            from tfm_kernels.rms_norm import rms_norm_rows
            return rms_norm_rows(table, index, self.weight, self.bias, self.eps)
        return self(F.embedding(index, table))

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x + r (a block's output joining the residual stream) and its norm -> (sum, norm); in CUDA inference one
        launch of `tfm_kernels.rms_norm.add_rms_norm` with the same roundings."""
        if inference_kernel_ok(x, r, self.weight, self.bias):
            from tfm_kernels.rms_norm import add_rms_norm
            return add_rms_norm(x, r, self.weight, self.bias, self.eps)
        x = x + r
        return x, self(x)


# Eager even inside torch.compile (a graph break): the tables are tiny, but computed in float64 and fused into
# every consumer, inductor re-evaluated pow/cos/sin in float64 per element of q and k (8 of the 59 ms of a
# Weaver training step at the Qwen3.6-27B preset, benchmarks/results/train_h200.json).
@torch.compiler.disable
def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """positions [...] (long) -> cos, sin [..., head_dim] (the half-split "rotate_half" convention)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq                  # [..., head_dim/2]
    ang = torch.cat([ang, ang], dim=-1)                                      # [..., head_dim]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D] or [T, D]."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]                                     # [B, 1, T, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of an MLP's two projections [..., I]; in CUDA inference one launch of
    `tfm_kernels.swiglu.silu_mul` with the same roundings (two launches)."""
    if inference_kernel_ok(gate, up):
        from tfm_kernels.swiglu import silu_mul as fused_silu_mul
        return fused_silu_mul(gate, up)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def save_safetensors_dir(path: str, config: dict, state_dict: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors atomically (each file via temp + rename)."""
    from safetensors.torch import save_file

    from tfm_runtime.io import atomic_path, atomic_write_json
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_path(os.path.join(path, "model.safetensors")) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    atomic_write_json(os.path.join(path, "config.json"), config)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets; "__metadata__"), after
    checking that the file is whole: a header that parses and tensor data that exactly fills the rest of the file.

    Raises ValueError naming the file and what is wrong (truncated, not safetensors, overlapping data)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path}: truncated or not a safetensors file: the header length field says {n} "
                             f"bytes, the file holds {size - 8} after it")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file: its {n}-byte header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file: its header is a {type(header).__name__}, not a mapping")
    data = size - 8 - n
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets in the header") from e
        if not 0 <= begin <= stop:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {[begin, stop]}")
        end = max(end, stop)
    if end > data:
        raise ValueError(f"{path}: truncated safetensors file: its tensors need {end} bytes of data, the file holds "
                         f"{data} ({end - data} missing)")
    if end < data:
        raise ValueError(f"{path}: damaged safetensors file: {data - end} bytes after the last tensor")
    return header


def load_safetensors_file(path: str) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, after `read_safetensors_header`'s checks; a library error (a wrong
    dtype or shape for the data) is re-raised as a ValueError that names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    read_safetensors_header(path)
    try:
        return load_file(path)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: unreadable safetensors file: {e}") from e


def load_safetensors_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read config.json + every *.safetensors file of a folder (never pickle)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"expected {cfg_path} (a model folder with config.json + *.safetensors)")
    with open(cfg_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        state.update(load_safetensors_file(f))
    return config, state


def safetensors_files(path: str) -> list[str]:
    """The *.safetensors files of a folder (paths, sorted); FileNotFoundError when there is none, naming any pickle
    checkpoints it holds (never loaded)."""
    names = sorted(os.listdir(path))
    files = [os.path.join(path, f) for f in names if f.endswith(".safetensors")]
    if not files:
        pickles = [f for f in names if f.endswith(PICKLE_SUFFIXES)]
        found = f"; it holds pickle checkpoints {pickles}, which are never loaded (unpickling can run code)" \
            if pickles else ""
        raise FileNotFoundError(f"no *.safetensors file in {path}{found}")
    return files


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """load_state_dict(strict=True) with an error that lists missing / unexpected / mis-shaped keys."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: expected {tuple(own[k].shape)}, got {tuple(state[k].shape)}"
              for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"{what}: weights do not match the config. missing={missing[:8]} "
                         f"unexpected={unexpected[:8]} shape mismatches={shapes[:8]}")
    module.load_state_dict(state, strict=True)
