"""The overlap statistics of benchmarks/candidate_overlap.py on hand-made candidate sets."""
import numpy as np

from benchmarks.candidate_overlap import overlap_stats


def test_overlap_stats_on_hand_cases():
    L, K = 3, 4
    same = np.tile(np.arange(K), (10, 1))                          # every position proposes tokens 0..3
    s = overlap_stats([same], L, K)
    assert s["rows"] == 8 and s["distinct_candidate_tokens"] == K
    assert s["row_union_fraction"]["mean"] == round(1 / L, 4)      # 4 distinct of 12 slots
    assert s["batch_union_fraction"]["8"] == round(K / (8 * L * K), 4)
    assert s["top_n_coverage"]["1024"] == 1.0
    disjoint = np.arange(10 * K).reshape(10, K)                    # nothing shared between positions
    d = overlap_stats([disjoint], L, K)
    assert d["row_union_fraction"]["mean"] == 1.0 and d["batch_union_fraction"]["8"] > 1 / L
    assert d["top_n_coverage"]["1024"] == 1.0 and d["distinct_candidate_tokens"] == 10 * K
