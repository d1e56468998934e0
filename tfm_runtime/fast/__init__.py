"""Fast backend: compact target models with static caches, and a decoder with SpeculativeDecoder's API."""
from tfm_runtime.fast.decoder import FastDecoder
from tfm_runtime.fast.dense import DenseConfig, DenseModel, DenseOutput
from tfm_runtime.fast.graphs import GraphedDense

__all__ = ["DenseConfig", "DenseModel", "DenseOutput", "FastDecoder", "GraphedDense"]
