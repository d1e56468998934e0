from tfm_kernels.weaver_frontier.ref import place_ref, push_ref
from tfm_kernels.weaver_frontier.triton import place, push

__all__ = ["place", "place_ref", "push", "push_ref"]
