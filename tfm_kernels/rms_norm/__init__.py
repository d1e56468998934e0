from tfm_kernels.rms_norm.ref import rms_norm_ref
from tfm_kernels.rms_norm.triton import rms_norm

__all__ = ["rms_norm", "rms_norm_ref"]
