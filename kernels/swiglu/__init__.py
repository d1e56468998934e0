from kernels.swiglu.ref import swiglu_ref
from kernels.swiglu.triton import swiglu

__all__ = ["swiglu", "swiglu_ref"]
