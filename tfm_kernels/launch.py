"""Launch features shared by the kernels: programmatic dependent launch (PDL), rows of a strided tensor."""
import functools
import os

import torch
import triton.language as tl


@functools.lru_cache(maxsize=1)
def _triton_has_pdl() -> bool:
    """Whether this Triton has gdc_wait / gdc_launch_dependents and the launch_pdl launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs sm_90+ and a Triton that exposes it (3.6 does);
    the interpreter has none."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()
            and _triton_has_pdl() and torch.cuda.get_device_capability(device)[0] >= 9)


def strided_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as [M, C] rows at one stride with a contiguous last dim (what a kernel reading rows `s` apart
    takes): a view where one exists, else a copy."""
    C = x.shape[-1]
    if x.stride(-1) == 1:
        try:
            return x.view(-1, C)
        except RuntimeError:                          # rows at more than one stride
            pass
    return x.reshape(-1, C).contiguous()
