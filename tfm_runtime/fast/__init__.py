"""Fast runtime paths: shape-static, CUDA-graph capturable versions of the reference runtime's steps."""
from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, WeaverTrees, weaver_tree_rounds

__all__ = ["StaticWeaverTreeBuilder", "WeaverTrees", "weaver_tree_rounds"]
