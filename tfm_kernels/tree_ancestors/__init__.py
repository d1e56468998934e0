from tfm_kernels.tree_ancestors.ref import ancestors_ref
from tfm_kernels.tree_ancestors.triton import tree_ancestors

__all__ = ["ancestors_ref", "tree_ancestors"]
