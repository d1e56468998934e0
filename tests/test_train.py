"""Training end to end on tiny-world shards (CPU, gloo): a 2-process ZeRO-2 Weaver run through the deepspeed
launcher, a SIGKILL + resume, DFlash drafter training, and refusals of bad input. Runs that need a process of their
own (the launcher's ranks, the runs that are killed) are subprocesses; the others run `python -m pipelines.train`'s
main in the test's interpreter (run_here), where torch, DeepSpeed and transformers are already imported."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from train_runs import split_outputs

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TOPICS = ["rivers", "prime numbers", "bread", "volcanoes", "chess", "tides", "owls", "glass", "maps", "clocks", "bees",
          "salt"]
WEAVER = {"d_rank": 64, "num_layers": 2, "num_heads": 2, "mlp_dim": 128, "lr": 3e-3, "warmup_steps": 5,
          "heldout_fraction": 0.15, "eval_budgets": [8, 16]}


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env={**_env(), **env}, capture_output=True, text=True, timeout=timeout)


def _train_here(run_here, *configs: str) -> list[tuple[int, str]]:
    """`python -m pipelines.train --config C --no-progress` for each config in turn, in this interpreter (the
    run_here fixture) -> [(exit code, the run's stderr and log)]."""
    return [(code, err) for code, _, err in (run_here("pipelines.train", "--config", c, "--no-progress")
                                             for c in configs)]


def _write(path, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def _metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


@pytest.fixture(scope="module")
def data(build_once):
    """Anchor shards and text-only shards of 96 prompts on the tiny llama world, collected in process once per test
    run (the xdist workers share them)."""
    return build_once("train_data", _collect)


def _collect(d):
    from pipelines.collect.__main__ import run
    from pipelines.collect.config import CollectConfig
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(96):
            f.write(json.dumps({"prompt": f"Tell me about {TOPICS[i % 12]} and {TOPICS[i * 7 % 12]} ({i})."}) + "\n")
    base = {"target": "tiny:llama:0", "drafter": "tiny:llama:0", "inputs": [str(d / "prompts.jsonl")],
            "max_new_tokens": 40, "anchors_per_sequence": 8, "candidate_pool": 64, "target_topk": 16,
            "samples_per_shard": 32, "max_prompt_tokens": 256}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(CollectConfig.from_dict({**base, "output_dir": str(d / "anchors")}), progress=False, use_ray=False)
        no_drafter = {k: v for k, v in base.items() if k != "drafter"}     # a target that has no drafter
        run(CollectConfig.from_dict({**no_drafter, "output_dir": str(d / "text"), "text_only": True,
                                     "max_new_tokens": 64}), progress=False, use_ray=False)
        run(CollectConfig.from_dict({**base, "output_dir": str(d / "nocand"), "store_candidates": False}),
            progress=False, use_ray=False)
    finally:
        torch.set_num_threads(threads)


# ---- 1. deepspeed launcher, 2 processes: ZeRO-2, and ZeRO-1/2 clipped by the optimizer --------------------------
def _clipped(data) -> dict:
    """Test 1b's runs: a clip of 0.05 binds at every step."""
    return {**WEAVER, "data": [str(data / "anchors")], "steps": 8, "micro_batch": 8, "eval_every": 1000,
            "eval_rows": 16, "eval_budgets": [4], "checkpoint_every": 1000, "log_every": 1, "precision": "fp32",
            "grad_clip": 0.05}


@pytest.fixture(scope="module")
def two_ranks(data, build_once):
    """The 2-process runs of tests 1 and 1b, trained in turn by one deepspeed launch (tests/train_runs.py: a launch
    starts three interpreters, each importing torch and DeepSpeed, which costs more than these short runs), once
    per test run: zero2/ (test 1), clip_zero1/ and clip_zero2/ (test 1b)."""
    return build_once("two_ranks", lambda d: _train_two_ranks(d, data))


def _train_two_ranks(d, data) -> None:
    zero2 = {**WEAVER, "data": [str(data / "anchors")], "output_dir": str(d / "zero2"), "steps": 60,
             "micro_batch": 8, "grad_accum": 2, "zero_stage": 2, "eval_every": 30, "eval_rows": 64,
             "checkpoint_every": 20, "keep_last": 1, "log_every": 1}
    cfgs = [_write(d / "zero2.json", zero2)]
    for stage in (1, 2):
        cfgs.append(_write(d / f"clip_zero{stage}.json", {**_clipped(data), "output_dir": str(d / f"clip_zero{stage}"),
                                                           "zero_stage": stage, "grad_accum": 2}))
    r = _run([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port",
              str(_port()), os.path.join(REPO, "tests", "train_runs.py"), *cfgs], PYTHONPATH=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert [rc for rc, _ in split_outputs(r.stderr)] == [0] * 2 * len(cfgs), r.stderr[-5000:]    # per rank


def test_two_process_zero2_lowers_loss_and_raises_simulated_acceptance(two_ranks):
    from tfm_runtime import load_adapter
    run = str(two_ranks / "zero2")
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert summary["world_size"] == 2 and summary["steps"] == 60
    # ZeRO-2 across 2 ranks: the optimizer state is partitioned, one file per rank
    ck = sorted(glob.glob(os.path.join(run, "checkpoints", "step-*")))
    assert os.path.basename(ck[-1]) == "step-00000060"
    assert len(glob.glob(os.path.join(ck[-1], "zero_pp_rank_*_optim_states.pt"))) == 2
    assert len(glob.glob(os.path.join(ck[-1], "rng_rank*.safetensors"))) == 2
    best = summary["best"]["step"]
    assert {os.path.basename(p) for p in ck} <= {"step-00000060", f"step-{best:08d}"}        # keep_last 1 + best

    m = _metrics(run)
    losses = [x["loss"] for x in m if x["kind"] == "train"]
    assert len(losses) == 60 and sum(losses[-10:]) / 10 < 0.75 * sum(losses[:5]) / 5
    # step_seconds (wall time per step since the last line) adds up to the run's time, evaluations included
    logged = sum(x["step_seconds"] for x in m if x["kind"] == "train")
    assert 0.7 * summary["seconds"] < logged <= summary["seconds"] * 1.01         # the last evaluation is not
    ev = {x["step"]: x for x in m if x["kind"] == "eval"}
    first, last = ev[0], ev[60]
    # the initial Weaver has a zero residual: it proposes DFlash's marginals exactly
    assert first["accept_chain_weaver"] == first["accept_chain_dflash"]
    assert first["top1_weaver"] == first["top1_dflash"]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["accept_chain_weaver"] > first["accept_chain_weaver"] + 0.3
    assert last["accept_weaver_16"] > first["accept_weaver_16"] + 0.2
    assert last["accept_weaver_16"] > last["accept_ddtree_16"]

    # the saved adapter loads through the runtime and reproduces the logged evaluation
    w = load_adapter(os.path.join(run, "final"))
    assert w.contract is not None and w.contract.candidate_pool == 64
    best_w = load_adapter(os.path.join(run, "best"))
    with open(os.path.join(run, "best", "config.json")) as f:
        assert json.load(f)["tfm"]["step"] == best
    assert sum(p.numel() for p in best_w.parameters()) == sum(p.numel() for p in w.parameters())


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 1b. ZeRO-1/2 on 2 ranks, clipped by the optimizer, against one rank clipped by DeepSpeed --------------------
def test_two_process_own_clipping_matches_deepspeed_clipping(data, two_ranks, tmp_path, run_here):
    """ZeRO 1 and 2 hand the optimizer each rank's half of the flat gradients; ClippedAdamW all-reduces the squared
    norm. A clip of 0.05 binds at every step, so a wrong norm changes the trajectory (without the all-reduce the loss
    moved by 1.6e-4 by step 6): the 2-rank runs (micro 8 x accum 2 x 2 ranks, ZeRO 1 and 2) must follow the 1-rank
    ZeRO-0 run (micro 8 x accum 4), whose clipping is DeepSpeed's."""
    one = str(tmp_path / "one")
    [(rc, out)] = _train_here(run_here, _write(tmp_path / "one.json", {**_clipped(data), "output_dir": one,
                                                                      "zero_stage": 0, "grad_accum": 4}))
    assert rc == 0, out[-5000:]
    a = [x for x in _metrics(one) if x["kind"] == "train"]
    for stage in (1, 2):
        b = [x for x in _metrics(str(two_ranks / f"clip_zero{stage}")) if x["kind"] == "train"]
        assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, 9)), stage
        assert min(y["grad_norm"] for y in b) > 0.05, stage                         # clipping bound every step
        assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) <= 1e-5, stage


# ---- 2. SIGKILL after a checkpoint, or SIGTERM, then resume: the same loss trace -------------------------------------
def test_resume_after_sigkill_or_sigterm_gives_the_uninterrupted_loss_trace(data, tmp_path, run_here):
    """A run SIGKILLed after its step-20 checkpoint, and one stopped by SIGTERM (a preempting scheduler: a checkpoint
    at the next step boundary, exit code 143), each resumed by the same config, log the loss trace of an
    uninterrupted run. The interrupted runs are processes of their own; the two resumptions and then the
    uninterrupted run run in this interpreter (run_here)."""
    base = {**WEAVER, "data": [str(data / "anchors")], "steps": 40, "micro_batch": 8, "grad_accum": 2,
            "eval_every": 30, "eval_rows": 16, "eval_budgets": [4], "checkpoint_every": 20, "log_every": 1,
            "precision": "fp32"}
    ref = str(tmp_path / "ref")
    ref_cfg = _write(tmp_path / "ref.json", {**base, "output_dir": ref})

    killed = str(tmp_path / "killed")
    killed_cfg = _write(tmp_path / "killed.json", {**base, "output_dir": killed})
    log = open(tmp_path / "killed.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "pipelines.train", "--config", killed_cfg, "--no-progress"],
                         cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    latest = os.path.join(killed, "checkpoints", "latest.json")
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end and p.poll() is None:
        try:
            with open(latest) as f:
                if json.load(f)["step"] == 20:
                    p.send_signal(signal.SIGKILL)
                    break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    p.wait(timeout=60)
    log.close()
    assert p.returncode == -signal.SIGKILL, open(tmp_path / "killed.log").read()[-3000:]
    assert not os.path.exists(os.path.join(killed, "summary.json"))                 # it died mid-run

    # SIGTERM: logged every 3 steps, so the loop reads most steps' loss and stop flag one step late (the lagged path).
    preempted = str(tmp_path / "preempted")
    preempted_cfg = _write(tmp_path / "preempted.json", {**base, "output_dir": preempted, "checkpoint_every": 1000,
                                                          "log_every": 3})
    p = subprocess.Popen([sys.executable, "-m", "pipelines.train", "--config", preempted_cfg, "--no-progress"],
                         cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end and p.poll() is None:
        try:
            if sum(x["kind"] == "train" for x in _metrics(preempted)) >= 3:
                p.send_signal(signal.SIGTERM)
                break
        except (FileNotFoundError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143, out[-3000:]
    with open(os.path.join(preempted, "checkpoints", "latest.json")) as f:
        stopped = json.load(f)["step"]
    assert 3 <= stopped < 40 and "checkpoint saved" in out
    assert not os.path.exists(os.path.join(preempted, "final"))
    assert not os.path.exists(os.path.join(preempted, "summary.json"))

    (rc_killed, out_killed), (rc_preempted, out_preempted), (rc_ref, out_ref) = _train_here(
        run_here, killed_cfg, preempted_cfg, ref_cfg)
    assert (rc_killed, rc_preempted, rc_ref) == (0, 0, 0), (out_killed + out_preempted + out_ref)[-5000:]
    assert "resumed from step-00000020" in out_killed, out_killed[-3000:]
    assert f"resumed from step-{stopped:08d}" in out_preempted, out_preempted[-3000:]

    def trace(path):
        return [(x["step"], x["loss"]) for x in _metrics(path) if x["kind"] == "train"]

    a, b = trace(ref), trace(killed)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 41))                # no step twice, none missing
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= 1e-5
    from tfm_runtime.models.common import load_safetensors_dir
    _, wa = load_safetensors_dir(os.path.join(ref, "final"))
    _, wb = load_safetensors_dir(os.path.join(killed, "final"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5)
    c = trace(preempted)
    assert [s for s, _ in c] == [s for s in range(1, 41) if s % 3 == 0 or s == 40]
    assert max(abs(x - dict(a)[s]) for s, x in c) <= 1e-5


# ---- 3. a DFlash drafter for a target that has none ------------------------------------------------------------
def test_dflash_training_beats_random_init_and_saves_zlab_layout(data, tmp_path, run_here):
    from tfm_runtime.loading import ModelSpec, load_drafter_config, load_target
    from tfm_runtime import SpeculativeDecoder
    from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
    run = str(tmp_path / "dflash")
    cfg = _write(tmp_path / "dflash.json", {"data": [str(data / "text")], "output_dir": run, "model": "dflash",
                                            "drafter_layers": 1, "block_size": 8, "anchors_per_sequence": 8,
                                            "steps": 100, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 20,
                                            "heldout_fraction": 0.15, "eval_every": 50, "eval_rows": 16,
                                            "checkpoint_every": 100, "log_every": 10})
    [(rc, out)] = _train_here(run_here, cfg)
    assert rc == 0, out[-5000:]
    ev = {x["step"]: x for x in _metrics(run) if x["kind"] == "eval"}
    assert ev[100]["loss"] < 0.8 * ev[0]["loss"]
    assert ev[100]["accept_chain"] > ev[0]["accept_chain"] + 1.0

    folder = os.path.join(run, "final")
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 8
    assert set(hf["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    with open(os.path.join(data, "text", "manifest.json")) as f:                   # collected without a drafter
        contract = json.load(f)["contract"]
    assert contract["drafter_id"] == "" and contract["tap_layer_ids"] == []
    assert hf["dflash_config"]["mask_token_id"] == contract["mask_token_id"] == contract["vocab_size"] - 1
    assert not glob.glob(os.path.join(folder, "*.bin")) and not glob.glob(os.path.join(folder, "*.pt"))
    trained = DFlashDrafter.from_pretrained(folder).eval()
    assert load_drafter_config(ModelSpec(folder)).to_hf_dict() == trained.cfg.to_hf_dict()   # collect can use it

    # Decoding with the real speculative decoder: more tokens per verify step than the random initialisation,
    # and still exactly the target's greedy output.
    torch.manual_seed(0)
    init = DFlashDrafter(DFlashConfig.from_hf_dict(hf)).eval()
    target = load_target(ModelSpec("tiny:llama:0"), trained.cfg.target_layer_ids, torch.device("cpu"), torch.float32)
    from tfm_runtime.loading import load_tokenizer
    tok = load_tokenizer(ModelSpec("tiny:llama:0"))
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i]} and {TOPICS[-i]} "
                                                                     f"({500 + i})."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(4)]                                                   # unseen, in distribution

    def accept(drafter):
        dec = SpeculativeDecoder(target, drafter, None, tree_budget=7, proposal="chain")
        outs = [dec.generate(p, max_new_tokens=32, temperature=0.0) for p in prompts]
        return outs, sum(o.stats.acceptance_length for o in outs) / len(outs)

    outs_t, a_trained = accept(trained)
    outs_i, a_init = accept(init)
    assert a_trained > a_init + 1.0, (a_trained, a_init)
    assert [o.tokens for o in outs_t] == [o.tokens for o in outs_i]                      # lossless either way


# ---- 4. bad input: clear errors before any training ------------------------------------------------------------
def test_bad_inputs_are_refused_with_clear_errors(data, tmp_path, run_here):
    """Each bad config is refused with exit code 2 and a message naming the problem, before any checkpoint."""
    base = {**WEAVER, "steps": 2, "micro_batch": 4, "eval_rows": 4, "eval_budgets": [4]}
    cases = [({"data": [str(data / "anchors"), str(data / "text")]}, "expected shards in 'anchors' mode"),
             ({"data": [str(data / "anchors")], "micro_batch": 4096}, "fewer than one global batch"),
             ({"data": [str(data / "anchors")], "score_group_rows": 64}, "score_group_rows x lookahead must be")]
    other = tmp_path / "other_run"                          # a run folder of another config is never resumed into
    other.mkdir()
    _write(other / "train_config.json", {"run_hash": "0123456789ab"})
    cases.append(({"data": [str(data / "anchors")], "output_dir": str(other)}, "holds a run with another config"))
    cfgs = [_write(tmp_path / f"bad{i}.json", {**base, "output_dir": str(tmp_path / f"run{i}"), **extra})
            for i, (extra, _) in enumerate(cases)]
    results = _train_here(run_here, *cfgs)
    for i, ((_, message), (rc, out)) in enumerate(zip(cases, results)):
        assert rc == 2 and message in out, (message, out[-2000:])
        assert not glob.glob(os.path.join(tmp_path / f"run{i}", "checkpoints", "step-*"))
    assert os.listdir(other) == ["train_config.json"]


# ---- 5. shards without stored candidates (half the bytes): candidates recomputed from dflash_hidden ----------
def test_candidates_recomputed_from_dflash_hidden_match_the_stored_ones(data):
    import numpy as np

    from pipelines.train.data import ShardData
    from pipelines.train.weaver_task import target_heads
    from tfm_runtime.contract import Contract
    from tfm_runtime.models.dflash import dflash_candidates
    sd = ShardData([str(data / "anchors")], mode="anchors", heldout_fraction=0.15, cache_dir=str(data / "hf"))
    rows = sd.rows(np.arange(64))
    _, head = target_heads(_spec(sd.contract), torch.device("cpu"), torch.float32)
    ids, vals = dflash_candidates(torch.tensor(rows["dflash_hidden"]), head, 64)
    stored_ids, stored_vals = torch.tensor(rows["cand_ids"]).long(), torch.tensor(rows["cand_logits"])
    # The stored logits came from the unrounded hidden state: equal within bf16 rounding; the id sets agree
    # except where neighbouring logits are that close.
    torch.testing.assert_close(vals, stored_vals, rtol=2 ** -7, atol=2e-2)
    same = [len(set(a.tolist()) & set(b.tolist())) / 64 for a, b in zip(ids.view(-1, 64), stored_ids.view(-1, 64))]
    assert min(same) >= 0.9 and sum(same) / len(same) > 0.98
    assert isinstance(sd.contract, Contract)


def _spec(contract):
    from tfm_runtime.loading import ModelSpec
    return ModelSpec(contract.target_id, contract.target_revision)


def test_weaver_trains_on_shards_without_stored_candidates(data, tmp_path, run_here, monkeypatch):
    """Also runs the step under torch.compile (`compile: on`; on GPU `auto` turns it on). Inductor builds its CPU
    kernels without the vector-ISA (AVX) code paths here: the same lowering and C++ code generation, and the run
    takes about 60% of the CPU time (GPU runs compile Triton kernels, not these)."""
    import torch._inductor.config as inductor
    monkeypatch.setattr(inductor.cpp, "vec_isa_ok", False)
    run = str(tmp_path / "run")
    cfg = _write(tmp_path / "t.json", {**WEAVER, "data": [str(data / "nocand")], "output_dir": run, "steps": 30,
                                       "micro_batch": 16, "eval_every": 30, "eval_rows": 32, "eval_budgets": [8],
                                       "checkpoint_every": 30, "compile": "on"})
    try:
        [(rc, out)] = _train_here(run_here, cfg)
    finally:                # a later compile of the objective in this worker starts afresh (static shapes)
        torch._dynamo.reset()
    assert rc == 0, out[-3000:]
    assert "torch.compile: the objective's forward is compiled" in out
    ev = {x["step"]: x for x in _metrics(run) if x["kind"] == "eval"}
    assert ev[30]["loss"] < 0.8 * ev[0]["loss"] and ev[30]["accept_weaver_8"] > ev[0]["accept_weaver_8"]


# ---- 6. the throughput benchmark (run on the H200 for train_h200.json) works end to end ----------------------
def test_train_bench_smoke_on_cpu(tmp_path):
    out, ext = str(tmp_path / "bench.json"), tmp_path / "torch_extensions"
    r = _run([sys.executable, "-m", "benchmarks.pipelines.train_bench", "--preset", "tiny", "--steps", "2",
              "--warmup", "1", "--global-batch", "8", "--out", out], TORCH_EXTENSIONS_DIR=str(ext))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not ext.exists(), list(ext.rglob("*"))           # no DeepSpeed op compiled for a CPU run (gloo)
    with open(out) as f:
        res = json.load(f)
    assert res["world_size"] == 1 and res["samples_per_s"] > 0 and len(res["loss_trace"]) == 3
    assert all(x == x and x > 0 for x in res["loss_trace"]) and res["flops_per_sample"] > 0
    assert res["mfu_vs_reference_peak"] == res["achieved_tflops"] / 808.0
