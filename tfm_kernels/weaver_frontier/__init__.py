from tfm_kernels.weaver_frontier.ref import finish_ref, place_ref, push_ref
from tfm_kernels.weaver_frontier.triton import finish, place, push

__all__ = ["finish", "finish_ref", "place", "place_ref", "push", "push_ref"]
