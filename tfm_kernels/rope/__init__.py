from tfm_kernels.rope.ref import rope_cache_ref, rope_qk_ref
from tfm_kernels.rope.triton import rope_cache, rope_qk

__all__ = ["rope_cache", "rope_cache_ref", "rope_qk", "rope_qk_ref"]
