"""Tree verification kernels for Gated DeltaNet layers (verify, commit, tree short conv)."""
from .commit import tree_gdn_commit
from .conv import tree_conv1d, tree_conv1d_commit
from .tree import check_parents, tree_ancestor_bits
from .verify import GDNTreeStash, GDNTuning, tree_gdn_verify

__all__ = [
    "GDNTreeStash",
    "GDNTuning",
    "check_parents",
    "tree_ancestor_bits",
    "tree_conv1d",
    "tree_conv1d_commit",
    "tree_gdn_commit",
    "tree_gdn_verify",
]
