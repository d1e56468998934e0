from tfm_kernels.greedy_accept.ref import greedy_accept_ref
from tfm_kernels.greedy_accept.triton import greedy_accept

__all__ = ["greedy_accept", "greedy_accept_ref"]
