from tfm_kernels.swiglu.ref import swiglu_ref
from tfm_kernels.swiglu.triton import swiglu

__all__ = ["swiglu", "swiglu_ref"]
