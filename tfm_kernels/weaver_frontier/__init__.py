from tfm_kernels.weaver_frontier.ref import place_ref
from tfm_kernels.weaver_frontier.triton import place

__all__ = ["place", "place_ref"]
