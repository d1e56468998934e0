"""The CUDA-graphed rollout engine (tfm_runtime.rollout) against Hugging Face generate on the same prompts, on a GPU:
float32 token for token; bfloat16 first logits within rounding of HF's, and every first divergence a rounding tie
(the distribution of first-divergence positions is printed: run with -s)."""
import json

import pytest
import torch

from tfm_runtime.rollout_check import compare_with_hf
from tfm_runtime.worlds import tiny_target

pytestmark = pytest.mark.gpu

ENGINE = dict(max_slots=16, min_bucket=4, check_every=4)      # 40 prompts in 16 slots: refills and compaction


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def model(family: str, dtype: torch.dtype):
    """A tiny random target with 128-wide layers (head_dim 32), on CUDA."""
    return tiny_target(family, dtype=dtype, hidden=128, layers=4, tap_layer_ids=()).model.cuda()


def show(name: str, report: dict) -> None:
    keys = ("identical", "mean_common_prefix", "first_divergence", "first_logits", "explained_by_rounding",
            "worst_margin_over_noise", "engine_stats")
    print(name, json.dumps({k: report[k] for k in keys}, indent=1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graphed_float32_equals_hf_generate(family):
    report = compare_with_hf(model(family, torch.float32), prompts(40, 0), 64,
                             reference=model(family, torch.float64), engine=ENGINE)
    show(f"{family} float32", report)
    assert report["engine_stats"]["captures"] >= 2, "the decode steps did not run as CUDA graphs"
    assert report["identical"] == 1.0, report["divergences"][:8]
    assert report["first_logits"]["within_rounding"], report["first_logits"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graphed_bfloat16_parts_from_hf_only_at_rounding_ties(family):
    report = compare_with_hf(model(family, torch.bfloat16), prompts(40, 1), 64,
                             reference=model(family, torch.bfloat16).float(), engine=ENGINE)
    show(f"{family} bfloat16", report)
    assert report["engine_stats"]["captures"] >= 2, "the decode steps did not run as CUDA graphs"
    assert report["first_logits"]["within_rounding"], report["first_logits"]
    assert report["explained_by_rounding"] == 1.0, [d for d in report["divergences"] if not d["rounding"]][:8]
