from tfm_kernels.tree_attention.ref import tree_attention_ref
from tfm_kernels.tree_attention.triton import TreeAttentionTuning, tree_attention
from tfm_kernels.tree_utils import ancestor_bitmask, ancestor_mask

__all__ = ["TreeAttentionTuning", "tree_attention", "tree_attention_ref", "ancestor_mask", "ancestor_bitmask"]
