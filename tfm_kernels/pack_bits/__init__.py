from tfm_kernels.pack_bits.ref import pack_bits_ref
from tfm_kernels.pack_bits.triton import pack_bits

__all__ = ["pack_bits", "pack_bits_ref"]
