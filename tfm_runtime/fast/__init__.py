"""Fast backend: compact target models with static caches (dense and GDN hybrid), shape-static (CUDA-graph
capturable) tree building, and a decoder with SpeculativeDecoder's API. The reference decoder (tfm_runtime.engine)
is its correctness oracle."""
from tfm_runtime.fast.ddtree import StaticChainBuilder, StaticDDTreeBuilder
from tfm_runtime.fast.decoder import FastDecoder
from tfm_runtime.fast.dense import DenseConfig, DenseModel, DenseOutput
from tfm_runtime.fast.graphs import GraphedTarget
from tfm_runtime.fast.hybrid import HybridConfig, HybridModel
from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, WeaverTrees, weaver_tree_rounds

__all__ = ["DenseConfig", "DenseModel", "DenseOutput", "FastDecoder", "GraphedTarget", "HybridConfig", "HybridModel",
           "StaticChainBuilder", "StaticDDTreeBuilder", "StaticWeaverTreeBuilder", "WeaverTrees",
           "weaver_tree_rounds"]
