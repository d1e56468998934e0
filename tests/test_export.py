"""Export and publish on the tiny world: train a Weaver and a DFlash drafter for a few steps, export them, push to a
Hub served on loopback (pipelines/loopback_hub.py, HF_ENDPOINT), load in fresh processes (online with an empty cache, then
offline from that cache); the SGLang layouts against tables of what their loaders read; refusals of bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pipelines.loopback_hub import LoopbackHub

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN, OTHER_TOKEN = "hf_test_write_token", "hf_test_other_token"
WEAVER = {"d_rank": 32, "num_layers": 2, "num_heads": 2, "mlp_dim": 64, "steps": 6, "micro_batch": 8,
          "lr": 3e-3, "warmup_steps": 2, "heldout_fraction": 0.2, "eval_every": 3, "eval_rows": 16,
          "eval_budgets": [4, 8], "checkpoint_every": 100, "log_every": 1, "zero_stage": 0, "precision": "fp32"}
DFLASH = {"model": "dflash", "drafter_layers": 2, "block_size": 8, "anchors_per_sequence": 4, "steps": 4,
          "micro_batch": 4, "lr": 3e-3, "warmup_steps": 2, "heldout_fraction": 0.2, "eval_every": 2, "eval_rows": 4,
          "checkpoint_every": 100, "log_every": 1, "zero_stage": 0, "precision": "fp32"}
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HF_TOKEN"):
        env.pop(k, None)
    return env


def _python(script: str, *args, env: dict, timeout: int = 300) -> dict:
    """Run `script` in a fresh interpreter; it prints one JSON object last."""
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tree(folder: str) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def hub():
    h = LoopbackHub({TOKEN: ("user", ["org"]), OTHER_TOKEN: ("other", [])})
    h.create("other/readonly")                        # public, but only "other" may write to it
    url = h.serve()
    yield h, url
    h.close()


# One interpreter runs the user's session: `python -m pipelines.train` on both configs, then `python -m
# pipelines.export` five times (HF_TOKEN set or unset per call), each through its module's main: importing torch,
# DeepSpeed and transformers once instead of seven times keeps the test fast.
SESSION = """
import contextlib, io, json, os, sys
from pipelines.export.__main__ import main as export
from pipelines.train.__main__ import main as train
configs, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2])
trained = [train(["--config", c, "--no-progress"]) for c in configs]
results = []
for step in steps:
    os.environ.pop("HF_TOKEN", None)
    if step["token"]:
        os.environ["HF_TOKEN"] = step["token"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = export(step["argv"])
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps({"trained": trained, "exports": results}))
"""


@pytest.fixture(scope="module")
def session(hub, tmp_path_factory):
    """Anchor and text-only shards of 16 prompts (collected in process); a 6-step Weaver run and a 4-step DFlash
    run; the Weaver run exported and pushed to org/weaver (with the SGLang fork file and benchmark results), the same
    command again, pushes without a token and to a repository without write access, and one to a branch of a new
    private repository."""
    from pipelines.collect.__main__ import run
    from pipelines.collect.config import CollectConfig
    h, url = hub
    d = tmp_path_factory.mktemp("export")
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Say something about the number {i} and {i * 7 % 5}."}) + "\n")
    base = {"target": "tiny:llama:0", "drafter": "tiny:llama:0", "inputs": [str(d / "prompts.jsonl")],
            "max_new_tokens": 24, "anchors_per_sequence": 4, "candidate_pool": 16, "target_topk": 8,
            "samples_per_shard": 16, "max_prompt_tokens": 128}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(CollectConfig.from_dict({**base, "output_dir": str(d / "anchors")}), progress=False, use_ray=False)
        text = {k: v for k, v in base.items() if k != "drafter"}
        run(CollectConfig.from_dict({**text, "output_dir": str(d / "text"), "text_only": True}), progress=False,
            use_ray=False)
    finally:
        torch.set_num_threads(threads)
    configs = []
    for name, cfg, data in (("weaver", WEAVER, "anchors"), ("dflash", DFLASH, "text")):
        with open(d / f"{name}.json", "w") as f:
            json.dump({**cfg, "data": [str(d / data)], "output_dir": str(d / name)}, f)
        configs.append(str(d / f"{name}.json"))

    bench = {"env": {"git_revision": "test"}, "world": "tiny-llama-seed0", "rows": [
        {"dataset": "mtbench", "proposal": "chain", "budget": 7, "temperature": 0.0, "verification": "greedy",
         "acceptance_length": 1.5, "mean_tree_size": 8.0},
        {"dataset": "mtbench", "proposal": "weaver", "budget": 8, "temperature": 0.0, "verification": "greedy",
         "acceptance_length": 2.25, "mean_tree_size": 9.0}]}
    with open(d / "bench.json", "w") as f:
        json.dump(bench, f)
    weaver = str(d / "weaver")
    pub = ["--run", weaver, "--out", str(d / "published"), "--repo-id", "org/weaver", "--push",
           "--format", "sglang-dflash-tfm", "--eval", str(d / "bench.json"), "--commit-message", "tiny weaver"]
    steps = [{"argv": pub, "token": TOKEN}, {"argv": pub, "token": TOKEN},
             {"argv": ["--run", weaver, "--out", str(d / "no_token"), "--repo-id", "org/weaver2", "--push"],
              "token": None},
             {"argv": ["--run", weaver, "--out", str(d / "no_access"), "--repo-id", "other/readonly", "--push"],
              "token": TOKEN},
             {"argv": ["--run", weaver, "--out", str(d / "branch"), "--repo-id", "org/private", "--push", "--private",
                       "--revision", "dev"], "token": TOKEN}]
    env = _env(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HOME=str(d / "hf_home"),
               HF_HUB_CACHE=str(d / "session_cache"))
    got = _python(SESSION, json.dumps(configs), json.dumps(steps), env=env, timeout=600)
    assert got["trained"] == [0, 0]
    return {"dir": d, "weaver": weaver, "dflash": str(d / "dflash"), "results": got["exports"],
            "out": str(d / "published"), "hub": h, "url": url}


# ---- 1. train -> export -> push -> load in a fresh process, online with an empty cache, then offline -------------
LOAD = """
import json, os, sys, torch
from huggingface_hub import ModelCard
from tfm_runtime import SpeculativeDecoder, load_adapter, load_drafter, load_target
from tfm_runtime.models.common import load_safetensors_dir
final, prompt = sys.argv[1], json.loads(sys.argv[2])
adapter = load_adapter("org/weaver")
_, ref = load_safetensors_dir(final)
state = adapter.state_dict()
identical = set(state) == set(ref) and all(torch.equal(state[k], v) for k, v in ref.items())
card = ModelCard.load("org/weaver")
drafter = load_drafter(adapter.contract.drafter_id)
target = load_target(adapter.contract.target_id, drafter.cfg.target_layer_ids)
adapter = load_adapter("org/weaver", target=target, drafter=drafter)
local = load_adapter(final, target=target, drafter=drafter)
outs = [SpeculativeDecoder(target, drafter, w, tree_budget=8).generate(prompt, max_new_tokens=16)
        for w in (adapter, local)]
try:
    load_adapter("org/pickled")
    pickled = None
except Exception as e:
    pickled = f"{type(e).__name__}: {e}"
cached = [f for _, _, fs in os.walk(os.environ["HF_HUB_CACHE"]) for f in fs]
print(json.dumps({"identical": identical, "sha": adapter.commit_sha, "card": card.data.to_dict(), "text": card.text,
                  "tokens": [o.tokens for o in outs], "accepts": [o.stats.accept_lengths for o in outs],
                  "pickled": pickled, "cached": cached}))
"""
OFFLINE = """
import json, sys
from tfm_runtime import load_adapter
a = load_adapter("org/weaver")
print(json.dumps({"sha": a.commit_sha, "vocab": a.contract.vocab_size}))
"""


@pytest.mark.slow
def test_push_then_load_from_the_hub_in_a_fresh_process_equals_the_run(session, tmp_path):
    h, url, results = session["hub"], session["url"], session["results"]
    first = results[0]
    assert first["code"] == 0, first["stderr"][-3000:]
    sha = first["stdout"].strip()
    repo = h.repos["org/weaver"]
    assert repo.branches["main"] == sha and repo.commits[-1].message == "tiny weaver"
    assert f"pushed org/weaver@main: commit {sha} (new commit) {url}/org/weaver/commit/{sha}" in first["stderr"]
    with open(os.path.join(session["out"], "push.json")) as f:            # recorded beside the artifact
        assert json.load(f)["commit_sha"] == sha
    assert "push.json" not in repo.commits[-1].tree                          # ... and never uploaded
    # a repository holding pickle checkpoints only
    h.commit(h.create("org/pickled"), "main", "pickle", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x02."}, [])

    cache = str(tmp_path / "cache")
    env = _env(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HUB_CACHE=cache,
               HF_HOME=str(tmp_path / "home"))
    got = _python(LOAD, os.path.join(session["weaver"], "final"), json.dumps(PROMPT), env=env)
    assert got["identical"] and got["sha"] == sha
    assert got["tokens"][0] == got["tokens"][1] and len(got["tokens"][0]) == 16
    assert got["accepts"][0] == got["accepts"][1]
    card = got["card"]
    assert card["library_name"] == "tfm" and card["pipeline_tag"] == "text-generation"
    assert card["license"] == "apache-2.0" and {"tfm", "weaver", "speculative-decoding"} <= set(card["tags"])
    for text in ("`tiny:llama:0`", 'load_adapter("org/weaver"', "--speculative-algorithm DFLASH_TFM",
                 "hf download org/weaver sglang_dflash_tfm.pt", "| depth | Weaver top-1 | DFlash top-1 |",
                 "| mtbench | 0.000 | weaver | 8 | greedy | 2.250 | 9.000 |", "![acceptance by depth](acceptance_by_depth.png)"):
        assert text in got["text"], text
    # pickle files are refused by name and never downloaded; neither is the fork's torch file
    assert "org/pickled" in got["pickled"] and "pytorch_model.bin" in got["pickled"], got["pickled"]
    assert not [f for f in got["cached"] if f.endswith((".bin", ".pt"))], got["cached"]

    seen = len(h.requests)
    offline = _python(OFFLINE, env={**env, "HF_HUB_OFFLINE": "1"})           # from the cache, no request made
    assert offline == {"sha": sha, "vocab": 262} and len(h.requests) == seen


@pytest.mark.slow
def test_pushing_the_same_artifact_again_adds_no_commit(session):
    h, (first, second) = session["hub"], session["results"][:2]
    assert second["code"] == 0, second["stderr"][-3000:]
    assert second["stdout"].strip() == first["stdout"].strip()
    assert "no change: the Hub already held these files" in second["stderr"]
    assert [c.message for c in h.repos["org/weaver"].commits] == ["initial commit", "tiny weaver"]


@pytest.mark.slow
def test_failed_pushes_say_why_and_keep_the_local_artifact(session):
    from pipelines.export.artifact import check_provenance
    h, d = session["hub"], session["dir"]
    no_token, no_access = session["results"][2:4]
    assert no_token["code"] == 3 and "no Hugging Face token" in no_token["stderr"], no_token["stderr"][-2000:]
    assert no_access["code"] == 3 and "no write access to other/readonly" in no_access["stderr"], \
        no_access["stderr"][-2000:]
    assert "org/weaver2" not in h.repos and len(h.repos["other/readonly"].commits) == 1
    for name in ("no_token", "no_access"):
        check_provenance(str(d / name))                                # complete: every file, every sha256
        assert not os.path.exists(d / name / "push.json")
    for r in session["results"]:
        assert TOKEN not in r["stdout"] + r["stderr"]


@pytest.mark.slow
def test_push_to_a_branch_of_a_new_private_repository(session):
    h, r = session["hub"], session["results"][4]
    assert r["code"] == 0, r["stderr"][-3000:]
    repo = h.repos["org/private"]
    assert repo.private and repo.branches["dev"] == r["stdout"].strip()
    assert repo.commit_at("main").message == "initial commit" and "model.safetensors" in repo.commit_at("dev").tree


# ---- 2. SGLang: the two layouts against tables of what their loaders read ------------------------------------------
# Upstream SGLang (>= 0.5.11) DFlashDraftModel for the tiny drafter: hidden 64, 4 heads / 2 KV heads of 16,
# intermediate 128, taps [1, 3] of a 6-layer target, 2 layers (python/sglang/srt/models/dflash.py, load_weights:
# q/k/v and gate/up are fused there, unknown keys are skipped).
SGLANG_DFLASH_TINY = {
    "fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,),
    **{f"layers.{i}.{k}": s for i in range(2) for k, s in {
        "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
        "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64), "self_attn.v_proj.weight": (32, 64),
        "self_attn.o_proj.weight": (64, 64), "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
        "mlp.gate_proj.weight": (128, 64), "mlp.up_proj.weight": (128, 64), "mlp.down_proj.weight": (64, 128)}.items()}}
# The fork's Weaver (trymirai/sglang, dflash_tfm.py, Weaver.load) for the tiny run: d_model = d_embed 64, d_rank 32,
# 2 blocks of 2 heads, mlp 64, K = lookahead 7, pool 16; every RMSNorm has a bias.
FORK_CONFIG_TINY = {"d_model": 64, "d_embed": 64, "d_rank": 32, "num_layers": 2, "num_heads": 2, "mlp_dim": 64,
                    "K": 7, "candidate_pool_size": 16, "encoder_mode": 3, "score_head": 4, "activation": "swiglu",
                    "rope_base": 10000.0}
FORK_WEAVER_TINY = {
    "output_norm.weight": (64,), "output_norm.bias": (64,), "embed_norm.weight": (64,), "embed_norm.bias": (64,),
    "token_in.weight": (32, 64), "token_in.bias": (32,), "proposal_in.weight": (32, 64), "proposal_in.bias": (32,),
    "out_norm.weight": (32,), "out_norm.bias": (32,), "lm_head_query_in.weight": (64, 32),
    **{f"blocks.{i}.{k}": s for i in range(2) for k, s in {
        "norm_attn.weight": (32,), "norm_attn.bias": (32,), "qkv_proj.weight": (96, 32), "o_proj.weight": (32, 32),
        "norm_mlp.weight": (32,), "norm_mlp.bias": (32,), "gate_up_proj.weight": (128, 32),
        "gate_up_proj.bias": (128,), "down_proj.weight": (32, 64), "down_proj.bias": (32,)}.items()}}


@pytest.mark.slow
def test_dflash_run_exports_the_layout_sglang_loads(session, tmp_path):
    from huggingface_hub import ModelCard

    from pipelines.export.__main__ import main
    from tfm_runtime.loading import ModelSpec, load_drafter_config
    from tfm_runtime.models.common import load_safetensors_dir, read_safetensors_header
    from tfm_runtime.models.dflash import DFlashDrafter
    out = str(tmp_path / "drafter")
    assert main(["--run", session["dflash"], "--model", "dflash", "--out", out, "--repo-id", "org/drafter"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert "DFlashDraftModel" in config["architectures"] and config["hidden_act"] == "silu"
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 261, "block_size": 8,
                                       "num_target_layers": 6}
    assert (config["block_size"], config["num_target_layers"]) == (8, 6)                   # z-lab's top level
    assert (config["intermediate_size"], config["num_key_value_heads"], config["head_dim"]) == (128, 2, 16)
    header = read_safetensors_header(os.path.join(out, "model.safetensors"))
    assert {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"} == SGLANG_DFLASH_TINY
    _, ref = load_safetensors_dir(os.path.join(session["dflash"], "final"))
    state = DFlashDrafter.from_pretrained(out).state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.items()) and set(state) == set(ref)
    assert load_drafter_config(ModelSpec(out)).target_layer_ids == [1, 3]                   # collect reads it too
    card = ModelCard.load(os.path.join(out, "README.md"))
    assert card.data.library_name == "tfm" and "dflash-drafter" in card.data.tags
    assert "--speculative-algorithm DFLASH" in card.text and "--speculative-num-draft-tokens 8" in card.text
    assert sorted(os.listdir(out)) == ["README.md", "acceptance_by_depth.png", "config.json", "model.safetensors",
                                       "provenance.json"]


@pytest.mark.slow
def test_weaver_in_the_fork_layout_matches_its_table_and_reloads_to_our_tensors(session):
    from pipelines.export.sglang import FORK_FILE
    from tfm_runtime.models.common import load_safetensors_dir
    payload = torch.load(os.path.join(session["out"], FORK_FILE), weights_only=True)
    assert payload["config"] == FORK_CONFIG_TINY
    assert {k: tuple(v.shape) for k, v in payload["state_dict"].items()} == FORK_WEAVER_TINY
    _, ours = load_safetensors_dir(os.path.join(session["weaver"], "final"))
    theirs = payload["state_dict"]
    renamed = {"attn_norm": "norm_attn", "mlp_norm": "norm_mlp"}
    for name, t in ours.items():
        fork = ".".join(renamed.get(p, p) for p in name.split("."))
        assert torch.equal(theirs[fork], t), name
    for bias in ("out_norm.bias", "blocks.0.norm_attn.bias", "blocks.1.norm_mlp.bias"):   # our norms have none
        assert not theirs[bias].any()


# ---- 3. bad input: clear refusals, nothing written, nothing pushed ---------------------------------------------------
def _copy_run(src: str, dst) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "tb", "hf_cache"))
    return str(dst)


@pytest.mark.slow
def test_bad_runs_and_contract_mismatches_are_refused_before_anything_is_written(session, tmp_path, capsys,
                                                                                 monkeypatch):
    import pipelines.export.artifact as artifact
    from pipelines.export.__main__ import main
    h = session["hub"]

    def refused(argv, *messages):
        assert main(argv) == 2
        err = capsys.readouterr().err
        for m in messages:
            assert m in err, (m, err[-2000:])

    def never(*args, **kwargs):
        raise AssertionError("push must not be reached")
    monkeypatch.setattr(artifact, "push", never)
    out = str(tmp_path / "out")
    incomplete = _copy_run(session["weaver"], tmp_path / "incomplete")
    os.remove(os.path.join(incomplete, "final", "model.safetensors"))
    refused(["--run", incomplete, "--out", out], "incomplete run", "lacks ['model.safetensors']")
    refused(["--run", str(tmp_path), "--out", out], "is not a training run folder: no train_config.json")
    refused(["--run", session["dflash"], "--out", out], "wrong model type", "says model 'dflash'", "--model dflash")
    refused(["--run", session["weaver"], "--model", "dflash", "--out", out], "wrong model type", "--model weaver")
    refused(["--run", session["weaver"], "--out", out, "--format", "sglang-dflash-tfm", "--model", "dflash"], "format")
    assert not os.path.exists(out)

    # an earlier artifact at --out, then a run whose contract disagrees with its target: refused before any push
    assert main(["--run", session["weaver"], "--out", out]) == 0
    before = _tree(out)
    bad = _copy_run(session["weaver"], tmp_path / "bad_contract")
    cpath = os.path.join(bad, "final", "contract.json")
    with open(cpath) as f:
        contract = json.load(f)
    with open(cpath, "w") as f:
        json.dump({**contract, "vocab_size": 300}, f)
    seen = len(h.requests)
    refused(["--run", bad, "--out", out, "--repo-id", "org/bad", "--push"], "field 'vocab_size' expected 300, got 262")
    assert len(h.requests) == seen and "org/bad" not in h.repos
    assert _tree(out) == before                                              # the earlier artifact, untouched
    assert sorted(os.listdir(tmp_path)) == ["bad_contract", "incomplete", "out"]   # no temp folder left
    os.makedirs(tmp_path / "not_an_artifact")
    refused(["--run", session["weaver"], "--out", str(tmp_path / "not_an_artifact")], "is not an export artifact")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["weaver", "dflash"])
def test_a_bf16_run_exports_in_bf16(session, tmp_path, model):
    """GPU runs save bf16 tensors: the export's reload keeps them bf16 and compares them bit for bit."""
    from safetensors.torch import load_file, save_file

    from pipelines.export.__main__ import main
    run = _copy_run(session[model], tmp_path / "bf16")
    path = os.path.join(run, "final", "model.safetensors")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()}, path)
    out = str(tmp_path / "out")
    assert main(["--run", run, "--out", out, "--model", model]) == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in got.values() if v.is_floating_point())


def test_help_names_every_option(capsys):
    from pipelines.export.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--run", "--out", "--repo-id", "--push", "--private", "--revision", "--commit-message", "--model",
                "--format", "--eval", "--checkpoint"):
        assert opt in text


def test_card_metadata_names_a_hub_target_as_base_model():
    from huggingface_hub import ModelCard

    from pipelines.export.card import CardInfo, metadata
    from tfm_runtime.loading import ModelSpec
    info = CardInfo(name="org/w", load_id="org/w", hub=True, run=None, target=ModelSpec("Qwen/Qwen3-8B", "abc"),
                    drafter=None, license="mit", datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"], parameters=1)
    data = ModelCard(metadata(info, ["tfm"]) + "# org/w\n").data
    assert (data.base_model, data.license, data.library_name) == ("Qwen/Qwen3-8B", "mit", "tfm")
    assert data.datasets == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    info.target = ModelSpec("tiny:llama:0")                              # not a Hub id: no base_model
    assert ModelCard(metadata(info, ["tfm"]) + "# x\n").data.base_model is None
