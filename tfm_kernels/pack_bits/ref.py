"""Bool masks packed into int32 words in torch ops: the reference of the kernel in `triton.py`."""
from tfm_kernels.tree_utils import pack_bits as pack_bits_ref

__all__ = ["pack_bits_ref"]
