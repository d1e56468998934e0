from tfm_kernels.small_attention.ref import small_attention_ref
from tfm_kernels.small_attention.triton import small_attention

__all__ = ["small_attention", "small_attention_ref"]
