from tfm_kernels.rope.ref import rope_qk_ref
from tfm_kernels.rope.triton import rope_qk

__all__ = ["rope_qk", "rope_qk_ref"]
