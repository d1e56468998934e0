"""tfm runtime: load Weaver adapters and decode with proposal trees (see README.md)."""
from tfm_runtime.contract import Contract, ContractError, check_compatible

__all__ = ["Contract", "ContractError", "check_compatible", "Tree", "SpeculativeDecoder", "load_adapter",
           "ModelSpec", "load_target", "load_drafter", "load_tokenizer"]
_LOADING = ("ModelSpec", "load_target", "load_drafter", "load_tokenizer")


def __getattr__(name):  # keep `import tfm_runtime` light: heavy pieces load on first use
    if name == "Tree":
        from tfm_runtime.tree import Tree
        return Tree
    if name == "SpeculativeDecoder":
        from tfm_runtime.engine import SpeculativeDecoder
        return SpeculativeDecoder
    if name in _LOADING:
        from tfm_runtime import loading
        return getattr(loading, name)
    if name == "load_adapter":
        from tfm_runtime.hub import load_adapter
        return load_adapter
    raise AttributeError(f"module 'tfm_runtime' has no attribute {name!r}")
