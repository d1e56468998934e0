from tfm_kernels.small_linear.ref import small_linear_ref, small_qkv_rope_ref
from tfm_kernels.small_linear.triton import (SMALL_M, SMALL_WEIGHT, small_linear, small_linear_fits,
                                             small_qkv_rope)

__all__ = ["SMALL_M", "SMALL_WEIGHT", "small_linear", "small_linear_fits", "small_linear_ref", "small_qkv_rope",
           "small_qkv_rope_ref"]
