"""The trainer's integrity: data verified and complete, the run hash over the data, non-finite steps skipped before
the optimizer applies them (and a run of them stopping the run), ZeRO-3 refused, checkpoint pruning and a torn
metrics line after a kill."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.train.config import TrainConfig

HELDOUT = 0.15


@pytest.fixture(scope="module")
def anchors(tmp_path_factory):
    """A tiny collect output: 12 sequences, 3 shards, 4 anchors per sequence."""
    from pipelines.collect.__main__ import run
    from pipelines.collect.config import CollectConfig
    d = tmp_path_factory.mktemp("anchors")
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(CollectConfig(target="tiny:llama:0", drafter="tiny:llama:0", inputs=[str(d / "prompts.jsonl")],
                          output_dir=str(d / "out"), max_new_tokens=12, anchors_per_sequence=4, candidate_pool=16,
                          target_topk=4, samples_per_shard=4, max_prompt_tokens=64), progress=False, use_ray=False)
    finally:
        torch.set_num_threads(threads)
    return str(d / "out")


def copy_of(folder: str, tmp_path, name: str = "data") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(folder, dst)
    return dst


def edit_manifest(folder: str, change) -> None:
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    change(m)
    with open(path, "w") as f:
        json.dump(m, f)


def shard_data(folder: str, tmp_path, **kw):
    from pipelines.train.data import ShardData
    return ShardData([folder], mode="anchors", heldout_fraction=HELDOUT, cache_dir=str(tmp_path / "hf_cache"), **kw)


# ---- data ----------------------------------------------------------------------------------------------------------
def test_train_refuses_an_incomplete_collect_unless_allowed(anchors, tmp_path):
    data = copy_of(anchors, tmp_path)
    edit_manifest(data, lambda m: m.update(complete=False))
    with pytest.raises(ValueError, match=r"data.*manifest\.json is not marked complete.*allow_incomplete_data"):
        shard_data(data, tmp_path)
    edit_manifest(data, lambda m: (m.pop("complete"), m.update(failed={"shard-00007-x.parquet": "OSError: disk"})))
    with pytest.raises(ValueError, match=r"not marked complete.*shard-00007-x\.parquet.*OSError: disk"):
        shard_data(data, tmp_path)
    assert len(shard_data(data, tmp_path, allow_incomplete=True).files) == 3
    a = TrainConfig(data=[data], output_dir="r")
    assert TrainConfig(data=[data], output_dir="r", allow_incomplete_data=True).run_hash() == a.run_hash()


def test_train_verifies_every_shard_by_sha256(anchors, tmp_path):
    data = copy_of(anchors, tmp_path)
    name = sorted(n for n in os.listdir(data) if n.endswith(".parquet"))[2]
    path = os.path.join(data, name)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:                                     # one flipped byte, the same size
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ValueError, match=f"{name}.*sha256"):
        shard_data(data, tmp_path)
    os.remove(path)
    with pytest.raises(ValueError, match=f"{name}.*missing"):
        shard_data(data, tmp_path)


def test_run_hash_covers_the_data_and_a_resume_on_changed_data_is_refused_by_name(anchors, tmp_path):
    from pipelines.train.data import data_fingerprint
    from pipelines.train.loop import check_run_dir, run_record
    data = copy_of(anchors, tmp_path)
    cfg = TrainConfig(data=[data], output_dir=str(tmp_path / "run"))
    fp, shards = data_fingerprint(cfg.data)
    assert cfg.run_hash(fp) != cfg.run_hash("0" * 16)
    os.makedirs(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "train_config.json"), "w") as f:
        json.dump(run_record(cfg, fp, shards), f)
    check_run_dir(cfg, fp, shards)                                   # the same run: resumes
    names = sorted(shards[data])
    extra = names[0].replace("shard-00000", "shard-00003")
    shutil.copy(os.path.join(data, names[0]), os.path.join(data, extra))
    edit_manifest(data, lambda m: m["shards"].update({extra: m["shards"][names[0]]}))
    fp2, shards2 = data_fingerprint(cfg.data)
    assert fp2 != fp and cfg.run_hash(fp2) != cfg.run_hash(fp)
    with pytest.raises(ValueError, match=f"holds a run with another config.*{extra} added"):
        check_run_dir(cfg, fp2, shards2)
    edit_manifest(data, lambda m: m["shards"].pop(names[1]))
    with pytest.raises(ValueError, match=f"{names[1]} removed"):
        check_run_dir(cfg, *data_fingerprint(cfg.data))
    other = TrainConfig(data=[anchors], output_dir=cfg.output_dir, lr=1e-2)
    with pytest.raises(ValueError, match=r"lr 0\.0006 -> 0\.01"):
        check_run_dir(other, fp, shards)


def test_rows_in_any_order_with_repeats_equal_the_tables_rows(anchors, tmp_path):
    sd = shard_data(anchors, tmp_path)
    assert len(sd.batches) >= 3                                  # one record batch per shard at least
    n = sd.table.num_rows
    index = np.random.default_rng(0).integers(0, n, size=2 * n)  # every batch, shuffled, repeats
    index[:3] = [n - 1, 0, n - 1]
    got, want = sd.take(index), sd.table.take(pa.array(index))  # want: Arrow's own take on the whole table
    assert got.equals(want) and got.column(0).num_chunks == 1
    rows = sd.rows(index[:5])
    assert list(rows["sample_id"]) == want.column("sample_id").to_pylist()[:5]
    assert sd.take(np.zeros(0, dtype=np.int64)).num_rows == 0
    with pytest.raises(IndexError, match="out of range"):
        sd.take([n])


# ---- config --------------------------------------------------------------------------------------------------------
def test_zero_stage_3_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1 or 2 .*stage 3.*got 3"):
        TrainConfig(data=["x"], output_dir="y", zero_stage=3)


# ---- non-finite steps ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [1.0, 0.0])               # the optimizer clips (ZeRO 1, 2) / DeepSpeed does (0)
def test_optimizer_skips_a_step_with_a_non_finite_loss_or_gradient_norm(max_norm):
    from pipelines.train.optim import ClippedAdamW
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=gen).requires_grad_(), torch.randn(7, generator=gen).requires_grad_()]
    opt = ClippedAdamW(params, max_norm=max_norm, partitioned=True, lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(ref_params, lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)

    def grads(poison=None):
        g = [torch.randn(p.shape, generator=gen) * 3 for p in params]
        for p, q, x in zip(params, ref_params, g):
            p.grad, q.grad = x.clone(), x.clone()
        if poison is not None:
            params[1].grad[2] = poison

    def take(loss: float, poisoned: bool) -> None:
        opt.loss = torch.tensor(loss)
        before = [p.detach().clone() for p in params]
        opt.step()
        if poisoned:
            assert all(torch.equal(a, b) for a, b in zip(before, params)), "a non-finite step reached the weights"
        assert bool(opt.skipped) == poisoned

    grads()
    take(1.0, poisoned=False)
    if max_norm:
        torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    ref.step()
    for poison, loss in ((float("nan"), 1.0), (float("inf"), 1.0), (None, float("nan")), (None, float("inf"))):
        grads(poison)
        take(loss, poisoned=True)
    grads()                                                          # the optimizer state is as if they never were
    take(1.0, poisoned=False)
    if max_norm:
        torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(int(s["step"]) == 2 for s in opt.state.values())


# ---- checkpoints and metrics after a kill --------------------------------------------------------------------------
class FakeEngine:
    """What checkpoint.save needs of a DeepSpeed engine: save_checkpoint writing one file per tag."""

    def save_checkpoint(self, folder, tag, client_state, save_latest):
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        torch.save(client_state, os.path.join(folder, tag, "mp_rank_00_model_states.pt"))


def test_pruning_counts_only_complete_checkpoints(tmp_path):
    from pipelines.train import checkpoint
    folder = str(tmp_path / "checkpoints")

    def steps():
        return sorted(d for d in os.listdir(folder) if d.startswith("step-"))

    engine = FakeEngine()
    for s in (10, 20):
        checkpoint.save(engine, folder, s, {"step": s}, keep_last=1, keep=set())
    assert steps() == ["step-00000020"]
    # a run resumed from step 20 had reached a save of step 40 when it was killed: a partial folder
    os.makedirs(os.path.join(folder, "step-00000040"))
    with open(os.path.join(folder, "step-00000040", "mp_rank_00_model_states.pt"), "wb") as f:
        f.write(b"half a file")
    checkpoint.save(engine, folder, 30, {"step": 30}, keep_last=1, keep=set())
    info = checkpoint.latest(folder)
    assert info["step"] == 30 and steps() == ["step-00000030"]       # 40 does not count (and is gone), 30 stays
    # killed again during a save: the resume discards what no latest.json names as complete
    os.makedirs(os.path.join(folder, "step-00000035"))
    checkpoint.discard_incomplete(folder)
    assert steps() == ["step-00000030"] and checkpoint.latest(folder)["step"] == 30
    checkpoint.save(engine, folder, 40, {"step": 40}, keep_last=2, keep=set())
    checkpoint.save(engine, folder, 50, {"step": 50}, keep_last=2, keep={30})
    assert steps() == ["step-00000030", "step-00000040", "step-00000050"]


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    from pipelines.train.loop import MetricsLog
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"kind": "train", "step": 5, "lo')      # killed in the middle of a line
    MetricsLog(str(tmp_path), resume_step=3, enabled=True).close()
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    path.write_text(lines[0] + '\n{"kind": "tr\n' + lines[1] + "\n")                # damage before the last line
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2"):
        MetricsLog(str(tmp_path), resume_step=3, enabled=True)


def test_bad_steps_are_skipped_counted_and_too_many_stop_the_run_with_exit_code_2(anchors, tmp_path, run_here):
    """Rows poisoned with NaN (stored past collect's validation) in the batches of steps 3, 6, 7 and 8: step 3 is
    skipped, 6-8 are three in a row (max_bad_steps 3), so the run stops at step 8 with exit code 2, naming the step
    and its rows, and keeps the step-6 checkpoint (written after one skipped step, with intact weights)."""
    from pipelines.provenance import file_sha256
    from pipelines.train.data import BatchOrder
    data = copy_of(anchors, tmp_path)
    sd = shard_data(data, tmp_path)
    order = BatchOrder(len(sd.train_index), micro=4, accum=1, world=1, seed=0)
    assert order.steps_per_epoch >= 8                                 # no row comes back within the run
    with open(os.path.join(data, "manifest.json")) as f:
        m = json.load(f)
    names = sorted(m["shards"])
    starts = np.cumsum([0] + [m["shards"][n]["rows"] for n in names])

    def where(step: int) -> dict[str, list[int]]:                    # step (1-based) -> {shard: rows in the shard}
        out: dict[str, list[int]] = {}
        for r in sorted(sd.train_index[order.indices(step - 1, 0, 0)].tolist()):
            i = int(np.searchsorted(starts, r, side="right")) - 1
            out.setdefault(names[i], []).append(r - int(starts[i]))
        return out

    poison: dict[str, set[int]] = {}
    for step in (3, 6, 7, 8):
        for name, rows in where(step).items():
            poison.setdefault(name, set()).update(rows)
    for name, rows in poison.items():
        path = os.path.join(data, name)
        table = pq.read_table(path)
        h = table.column("h_final").combine_chunks()
        bits = h.flatten().to_numpy().copy().reshape(len(table), -1)
        bits[sorted(rows)] = 0x7FC0                                  # bf16 NaN
        table = table.set_column(table.schema.get_field_index("h_final"), table.schema.field("h_final"),
                                 pa.FixedSizeListArray.from_arrays(pa.array(bits.reshape(-1)), h.type.list_size))
        pq.write_table(table, path, compression="zstd")
        m["shards"][name].update(bytes=os.path.getsize(path), sha256=file_sha256(path))
    with open(os.path.join(data, "manifest.json"), "w") as f:
        json.dump(m, f)

    run = str(tmp_path / "run")
    cfg = {"data": [data], "output_dir": run, "d_rank": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64,
           "steps": 8, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 2, "heldout_fraction": HELDOUT,
           "eval_every": 100, "eval_rows": 4, "eval_budgets": [2], "checkpoint_every": 2, "keep_last": 1,
           "log_every": 1, "precision": "fp32", "max_bad_steps": 3}
    with open(tmp_path / "train.json", "w") as f:
        json.dump(cfg, f)
    code, _, err = run_here("pipelines.train", "--config", str(tmp_path / "train.json"), "--no-progress")
    assert code == 2, err[-5000:]
    assert "Traceback" not in err, err[-5000:]
    assert "step 8: 3 consecutive steps" in err, err[-3000:]
    for name, rows in where(8).items():
        assert f"{os.path.join(data, name)} rows {rows}" in err, (name, rows, err[-3000:])
    with open(os.path.join(run, "metrics.jsonl")) as f:
        lines = [json.loads(ln) for ln in f]
    assert [x["step"] for x in lines if x["kind"] == "skipped"] == [3, 6, 7, 8]
    assert [(x["step"], x["skipped_steps"]) for x in lines if x["kind"] == "train"] == [(1, 0), (2, 0), (4, 1), (5, 1)]
    from pipelines.train import checkpoint
    ck = os.path.join(run, "checkpoints")
    assert checkpoint.latest(ck)["step"] == 6
    state = torch.load(os.path.join(ck, "step-00000006", "mp_rank_00_model_states.pt"), weights_only=False)
    assert state["skips"] == {"total": 2, "in_a_row": 1}
    assert all(torch.isfinite(t).all() for t in state["module"].values()), "a skipped step reached the weights"


def test_temp_files_a_kill_left_are_removed_on_resume(tmp_path):
    from pipelines.train.loop import remove_temp_files
    run = tmp_path / "run"
    left = [run / ".metrics.jsonl.ab12cd.tmp", run / "checkpoints" / ".latest.json.x1y2z3.tmp",
            run / "final" / ".model.safetensors.q9w8e7.tmp", run / "best" / ".config.json.k3j4h5.tmp"]
    kept = [run / "metrics.jsonl", run / "final" / "model.safetensors", run / "notes.tmp.txt"]
    for p in left + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    assert remove_temp_files(str(run)) == len(left)
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)


def test_metrics_of_a_run_killed_before_its_first_checkpoint_start_over(tmp_path):
    """No checkpoint: the run starts at step 0 again and re-evaluates step 0, so no line of the killed run stays."""
    from pipelines.train.loop import MetricsLog
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": k, "step": s}) + "\n" for k, s in (("eval", 0), ("train", 1))))
    MetricsLog(str(tmp_path), resume_step=0, enabled=True).close()
    assert path.read_text() == ""
