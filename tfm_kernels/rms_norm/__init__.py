from tfm_kernels.rms_norm.ref import rms_norm_ref
from tfm_kernels.rms_norm.triton import add_rms_norm, rms_norm, rms_norm_rows

__all__ = ["add_rms_norm", "rms_norm", "rms_norm_ref", "rms_norm_rows"]
