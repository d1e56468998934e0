"""benchmarks/runtime/runtime_bench.py --smoke: every engine's row on the tiny world (CPU), the tree-build timing, the
ratios, the greedy cross-check of FastDecoder against SpeculativeDecoder and the profiler trace per stage; the
warm-up of every engine on every prompt."""
import json

import pytest
import torch

from benchmarks.runtime import runtime_bench


def test_smoke_rows(tmp_path):
    out = tmp_path / "runtime.json"
    assert runtime_bench.main(["--smoke", "--weaver-steps", "16", "2", "--trace", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res)[:2] == ["env", "setup"] and res["setup"]["smoke"] and res["errors"] == {} and res["complete"]
    rows, n = res["rows"], res["setup"]["new_tokens"] * res["setup"]["num_prompts"]
    got = {(r["engine"], r.get("budget"), r.get("width")) for r in rows}
    want = {("ours ar", None, None), ("hf static eager", None, None)} | {
        (f"ours {p}", b, None) for p in ("chain", "ddtree") for b in (4, 8)} | {
        ("ours weaver", 4, 1), ("ours weaver", 4, 2), ("ours weaver", 8, 1), ("ours weaver", 8, 4)}
    assert got == want                                          # no compiled HF row and no CUDA graphs on the CPU
    for r in rows:
        assert r["new_tokens"] == n and r["tokens_per_s"] > 0 and r["ms_per_token"] > 0, r
        if r["engine"].startswith("ours "):
            assert r["cuda_graphs"] is False and r["step_ms"] > 0
        if r["engine"] in ("ours chain", "ours ddtree", "ours weaver"):
            assert set(r["stage_ms"]) == {"draft", "tree", "verify", "commit"} and r["acceptance_length"] >= 1
            # --trace: the profiler ranges of the decoder's stages, each once per verify step of the traced call
            t, steps = r["trace"], r["verify_steps"] // r["prompts"]
            assert set(t) == {"prefill", "draft", "tree", "verify", "commit"} and t["prefill"]["calls"] == 1
            assert all(t[k]["calls"] == steps for k in ("draft", "tree", "verify", "commit"))
            assert all(v["wall_ms"] > 0 for v in t.values()) and "ops" not in t["tree"]    # kernels: CUDA only
    ar = next(r for r in rows if r["engine"] == "ours ar")
    assert set(ar["trace"]) == {"decode"} and ar["trace"]["decode"]["calls"] == res["setup"]["new_tokens"] - 1
    build = res["tree_build"]
    assert build["budget"] == 8 and build["equals_reference"] and build["static_eager_ms"] > 0
    assert build["ddtree_equals_reference"] and build["ddtree_static_eager_ms"] > 0
    assert "static_captured_ms" not in build and "ddtree_static_captured_ms" not in build
    assert build["few_rounds"]["rounds"] == 8 and build["few_rounds"]["eager_ms"] > 0   # width 1 at budget 8
    ratios = res["ratios"]
    assert ratios["ar_over_hf_static_compiled"]["value"] is None and ratios["tree_build_ms_captured"]["met"] is None
    assert ratios["weaver_step_over_ar_step"]["value"] > 0
    best = max((r for r in rows if r["engine"] == "ours weaver" and r["budget"] == 8), key=lambda r: r["tokens_per_s"])
    assert ratios["best_width"] == best["width"] and ratios["best_width_weaver_tokens_per_s_over_ar"]["value"] == round(
        best["tokens_per_s"] / next(r for r in rows if r["engine"] == "ours ar")["tokens_per_s"], 4)
    assert "best_width_weaver_tokens_per_s_over_ar" in runtime_bench.table(res)
    ar = next(r for r in rows if r["engine"] == "ours ar")
    assert ratios["steady_state_over_ar"]["best_width"] == round(
        best["acceptance_length"] / best["step_ms"] * ar["step_ms"], 4)                # decode steps alone
    assert "steady state" in runtime_bench.table(res)
    check = res["crosscheck"]
    assert check["cases"] == 3 and check["identical"] == 3 and check["ar_identical"] == 1 and not check["mismatches"]


def test_a_run_cut_short_keeps_its_rows_and_a_failed_stage_its_error(tmp_path, monkeypatch):
    out = tmp_path / "runtime.json"

    def broken_build(*args):
        raise RuntimeError("no graph today")

    def killed(*args):
        raise KeyboardInterrupt                                 # the time limit, part way through the cross-check
    monkeypatch.setattr(runtime_bench, "tree_build", broken_build)
    monkeypatch.setattr(runtime_bench, "crosscheck", killed)
    with pytest.raises(KeyboardInterrupt):
        runtime_bench.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert not res["complete"] and len(res["rows"]) == 8 and "crosscheck" not in res
    assert res["tree_build"] == {"error": "RuntimeError: no graph today"}
    assert res["ratios"]["tree_build_ms_captured"]["value"] is None
    assert "tree build timing: error RuntimeError" in runtime_bench.table(res)


def test_committed_mtbench_ids(monkeypatch):
    """The committed MT-Bench token ids are SmolLM2's chat-templated first turns (checked where the tokenizer and the
    package data are installed), and the benchmark falls back to them where nothing tokenizes."""
    import argparse

    import pytest
    with open(runtime_bench.MTBENCH_IDS) as f:
        ids = json.load(f)["prompts"]
    assert len(ids) >= 4 and all(p[0] == 1 and len(p) > 20 for p in ids)
    try:
        want = runtime_bench.mtbench_ids(None, len(ids))
    except (ImportError, OSError, ValueError) as e:
        pytest.skip(f"no SmolLM2 tokenizer or MT-Bench data here: {e}")
    assert ids == want

    def no_tokenizer(*_):
        raise FileNotFoundError("no tokenizer")
    monkeypatch.setattr(runtime_bench, "mtbench_ids", no_tokenizer)
    got, source = runtime_bench.load_prompts(argparse.Namespace(smoke=False, target=None, prompts=4,
                                                                prompt_file=None), 49152)
    assert got == ids[:4] and "smollm2_mtbench_ids.json" in source


def test_prompt_file(tmp_path):
    """--prompt-file: MT-Bench's first turns written as a .jsonl (as `pipelines.prompts --out` does) give the
    committed MT-Bench ids; a file with fewer prompts than asked for is refused by name, with no fallback."""
    import argparse

    import pytest
    with open(runtime_bench.MTBENCH_IDS) as f:
        ids = json.load(f)["prompts"]
    try:
        from pipelines.prompts import mtbench
        records = mtbench()[:4]
    except (ImportError, OSError, ValueError) as e:
        pytest.skip(f"no MT-Bench data here: {e}")
    path = tmp_path / "mtbench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = argparse.Namespace(smoke=False, target=None, prompts=4, prompt_file=str(path))
    try:
        got, source = runtime_bench.load_prompts(args, 49152)
    except OSError as e:
        pytest.skip(f"no SmolLM2 tokenizer here: {e}")
    assert got == ids[:4] and str(path) in source
    args.prompts = 5
    with pytest.raises(ValueError, match="has 4 prompts, --prompts asks for 5"):
        runtime_bench.load_prompts(args, 49152)


def test_shape27b_smoke(tmp_path):
    """benchmarks/runtime/shape27b_bench.py --smoke: the hybrid target in a tiny shape on the CPU gives every budget's
    row, with the acceptance lengths of the committed results file for the projection."""
    from benchmarks.runtime import shape27b_bench
    out = tmp_path / "shape.json"
    res = shape27b_bench.main(["--smoke", "--reps", "1", "--budgets", "16", "64", "--out", str(out)])
    assert json.loads(out.read_text())["budgets"] == res["budgets"] and list(res)[:2] == ["env", "setup"]
    assert res["setup"]["target"]["gdn_layers"] == 3 and res["setup"]["target"]["attention_layers"] == 1
    assert res["ar"]["ms"] > 0 and res["draft_ms"] > 0
    assert res["ar"]["floor_ms"] is None and res["goals"]["ar_over_floor <= 1.15"] is None   # no floor off the H200
    for r, budget in zip(res["budgets"], (16, 64)):
        assert r["budget"] == budget and 1 < r["nodes"] <= budget + 1
        assert r["verify_ms"] > 0 and r["tree_build_ms"] > 0 and r["acceptance_length"] > 1
        assert abs(r["projected_speedup_over_ar"] - r["acceptance_length"] * res["ar"]["ms"] / r["step_ms"]) < 0.01


@pytest.mark.parametrize("warm_all", [False, True])
def test_run_engine_warms_up_every_prompt(warm_all):
    """No engine's timed calls meet a prompt for the first time: the process-wide first-shape costs (cuBLAS
    heuristics, kernel specialisations) would otherwise fall on whichever engine is measured first."""
    calls = []

    def call(prompt, n):
        calls.append((prompt, n))
        return [0] * n, None

    row, outs = runtime_bench.run_engine("fake", call, ["a", "bb", "ccc"], 32, torch.device("cpu"),
                                         warm_all=warm_all)
    short = 32 if warm_all else runtime_bench.WARM_TOKENS
    assert calls == [("a", 32), ("bb", short), ("ccc", short), ("a", 32), ("bb", 32), ("ccc", 32)]
    assert row["prompts"] == 3 and row["new_tokens"] == 96 and outs == [[0] * 32] * 3

