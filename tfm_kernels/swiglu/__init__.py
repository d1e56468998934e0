from tfm_kernels.swiglu.ref import swiglu_ref
from tfm_kernels.swiglu.triton import silu_mul, swiglu

__all__ = ["silu_mul", "swiglu", "swiglu_ref"]
