"""Collect's integrity, in process (no Ray): shard verification by sha256, the manifest's `complete` mark, failed
shards (retried, recorded, retried alone by the next run), a stalled Ray job, the kept-response limit, text-only
validation."""
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from pipelines.collect.__main__ import main as collect_main
from pipelines.collect.__main__ import Stalled, rows_until_stall, run
from pipelines.collect.config import CollectConfig
from pipelines.shards import read_manifest

N_PROMPTS = 9                                  # 3 shards of 3 samples


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                   # tiny matmuls: more threads only spin
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(N_PROMPTS):
            f.write(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n")
    return str(path)


def config(tmp_path, inputs, **kw) -> CollectConfig:
    base = dict(target="tiny:llama:0", drafter="tiny:llama:0", inputs=inputs, output_dir=str(tmp_path / "out"),
                max_new_tokens=6, anchors_per_sequence=2, candidate_pool=8, target_topk=4, samples_per_shard=3,
                max_prompt_tokens=64)
    base.update(kw)
    return CollectConfig(**base)


def shard_files(out: str) -> list[str]:
    return sorted(f for f in os.listdir(out) if f.endswith(".parquet"))


def test_verify_shard_checks_presence_size_and_sha256_once_per_file_version(tmp_path, monkeypatch):
    from pipelines import shards
    path = str(tmp_path / "s.parquet")
    with open(path, "wb") as f:
        f.write(b"0123456789")
    facts = {"bytes": 10, "sha256": shards.file_sha256(path)}
    hashed = []
    real = shards.file_sha256
    monkeypatch.setattr(shards, "file_sha256", lambda p: hashed.append(p) or real(p))
    shards.verify_shard(path, facts)
    shards.verify_shard(path, facts)
    assert len(hashed) <= 1                                          # cached by (path, size, mtime)
    with open(path, "r+b") as f:                                     # same size, other bytes, later mtime
        f.write(b"X")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10 ** 9))
    with pytest.raises(ValueError, match=r"s\.parquet.*sha256"):
        shards.verify_shard(path, facts)
    with pytest.raises(ValueError, match=r"s\.parquet.*10 bytes"):
        shards.verify_shard(path, {**facts, "bytes": 11})
    with pytest.raises(ValueError, match=r"missing\.parquet.*missing"):
        shards.verify_shard(str(tmp_path / "missing.parquet"), facts)


def test_resume_redoes_a_shard_whose_bytes_changed_at_the_same_size(tmp_path, prompts):
    cfg = config(tmp_path, [prompts])
    run(cfg, progress=False, use_ray=False)
    m = read_manifest(cfg.output_dir)
    names = shard_files(cfg.output_dir)
    assert len(names) == 3 and sorted(m["shards"]) == names
    victim = os.path.join(cfg.output_dir, names[1])
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:                                   # one flipped byte inside the data pages
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    kept = {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in (names[0], names[2])}
    run(cfg, progress=False, use_ray=False)
    m2 = read_manifest(cfg.output_dir)
    assert m2["shards"][names[1]]["sha256"] == m["shards"][names[1]]["sha256"]       # rewritten, same bytes
    from pipelines.provenance import file_sha256
    assert file_sha256(victim) == m["shards"][names[1]]["sha256"]
    assert {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in kept} == kept   # intact: skipped


def test_manifest_is_marked_complete_last_after_every_shard(tmp_path, prompts, monkeypatch):
    from pipelines import shards
    saves = []
    real = shards.atomic_write_json

    def spy(path, obj):
        if path.endswith("manifest.json"):
            saves.append((obj.get("complete"), len(obj["shards"])))
        return real(path, obj)

    monkeypatch.setattr(shards, "atomic_write_json", spy)
    cfg = config(tmp_path, [prompts])
    summary = run(cfg, progress=False, use_ray=False)
    assert summary["complete"] is True and summary["failed"] == {}
    assert saves[-1] == (True, 3)                                    # the mark comes with the last write...
    assert all(c is False for c, _ in saves[:-1])                    # ...and with no earlier one
    m = read_manifest(cfg.output_dir)
    assert m["complete"] is True and m["failed"] == {}
    saves.clear()
    run(cfg, progress=False, use_ray=False)                          # a resume with nothing to do stays complete
    assert saves[-1] == (True, 3) and read_manifest(cfg.output_dir)["complete"] is True


def test_failed_shard_is_retried_then_recorded_and_the_next_run_retries_only_it(tmp_path, prompts, monkeypatch,
                                                                                capsys):
    from pipelines.collect import job
    cfg = config(tmp_path, [prompts])                                # shard_retries: 2 (the default)
    calls: dict[int, int] = {}
    real = job.featurize_batch

    def flaky(target, drafter, samples, **kw):                       # shard k holds samples 3k..3k+2
        k = samples[0].sample_id // 3
        calls[k] = calls.get(k, 0) + 1
        if k == 0 and calls[k] == 1:
            raise RuntimeError("transient failure")
        if k == 1:
            raise RuntimeError("this shard always fails")
        return real(target, drafter, samples, **kw)

    monkeypatch.setattr(job, "featurize_batch", flaky)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert collect_main(["--config", str(path), "--no-ray", "--no-progress"]) == 3
    summary = json.loads(capsys.readouterr().out)
    m = read_manifest(cfg.output_dir)
    assert calls == {0: 2, 1: 3, 2: 1}                               # 1 + shard_retries attempts at most
    bad = [f"shard-00001-{m['config_hash']}.parquet"]
    assert sorted(m["failed"]) == bad == sorted(summary["failed"])
    assert "RuntimeError: this shard always fails" in m["failed"][bad[0]]
    assert m["complete"] is False and summary["complete"] is False
    assert sorted(m["shards"]) == shard_files(cfg.output_dir) and len(m["shards"]) == 2   # the others completed
    kept = {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in m["shards"]}

    monkeypatch.setattr(job, "featurize_batch", real)
    written = []
    real_write = job.write_shard
    monkeypatch.setattr(job, "write_shard", lambda table, p: written.append(os.path.basename(p)) or real_write(table, p))
    summary = run(cfg, progress=False, use_ray=False)
    assert written == bad                                            # only the failed shard is collected again
    assert summary["complete"] is True and summary["failed"] == {}
    m = read_manifest(cfg.output_dir)
    assert m["complete"] is True and m["failed"] == {} and len(m["shards"]) == 3
    assert {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in kept} == kept


def test_max_response_tokens_skips_and_counts_long_kept_responses(tmp_path):
    f = tmp_path / "chats.jsonl"
    long = " ".join(["word"] * 60)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]}
            for i, a in enumerate(["short", long, "also short", long])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tmp_path, [str(f)], response="keep", max_response_tokens=20, samples_per_shard=8)
    summary = run(cfg, progress=False, use_ray=False)
    m = read_manifest(cfg.output_dir)
    assert m["skipped"] == {"response_too_long": 2} == summary["skipped"]
    (shard,) = m["shards"].values()
    assert shard["samples"] == [0, 2]
    with pytest.raises(ValueError, match="max_response_tokens must be >= 1"):
        config(tmp_path, [str(f)], max_response_tokens=0)
    # the limit does not touch regenerated responses (max_new_tokens bounds those): their hash ignores it
    assert config(tmp_path, ["x"]).data_hash() == config(tmp_path, ["x"], max_response_tokens=7).data_hash()
    assert config(tmp_path, ["x"], response="keep").data_hash() != \
        config(tmp_path, ["x"], response="keep", max_response_tokens=7).data_hash()


def test_text_only_shards_are_validated(tmp_path):
    import pyarrow as pa

    from pipelines.collect.job import Featurize
    from pipelines.collect.models import check_pair
    cfg = config(tmp_path, ["x"], drafter=None, text_only=True)
    contract = check_pair(cfg).to_dict()
    V = contract["vocab_size"]
    stage = Featurize(cfg.to_dict(), contract)
    good = {"shard": 0, "name": "shard-00000-x.parquet", "samples": [0, 1], "sample_ids": [0, 1],
            "prompt_ids": [[1, 2, 3], [4, 5]], "response_ids": [[6, 7], [8]]}

    def call(row) -> dict:
        out = stage(pa.Table.from_pylist([row]))
        return {k: v[0] for k, v in out.items()}

    out = call(good)
    assert not out.get("error")
    table = pa.ipc.open_stream(out["table"]).read_all()
    assert table.column("input_ids").to_pylist() == [[1, 2, 3, 6, 7], [4, 5, 8]]
    for bad, match in [({"response_ids": [[6, V], [8]]}, "outside"),
                       ({"response_ids": [[6, 7], []]}, "no response token")]:
        out = call({**good, **bad})                                  # a failed shard: an error row, no table
        assert "table" not in out and re.search(f"shard validation.*{match}", out.get("error") or ""), out
    from pipelines.shards import validate_text
    rows = {"sample_id": np.array([0, 1]), "input_ids": [[1, 2, 3, 6, 7], [4, 5, 9]], "prompt_len": np.array([3, 2])}
    with pytest.raises(ValueError, match="sample 1.*misaligned"):
        validate_text(rows, {0: [1, 2, 3, 6, 7], 1: [4, 5, 8]}, V)


def test_rows_until_stall_passes_rows_and_errors_and_stops_on_a_stall():
    assert list(rows_until_stall(iter([1, 2, 3]), 5)) == [1, 2, 3]

    def crashing():
        yield 1
        raise RuntimeError("the worker died")
    with pytest.raises(RuntimeError, match="the worker died"):
        list(rows_until_stall(crashing(), 5))
    hang = threading.Event()

    def stuck():
        yield 1
        hang.wait()
    got, t = [], time.perf_counter()
    with pytest.raises(Stalled, match=r"no shard finished in 0.5 s \(stall_seconds\)"):
        for row in rows_until_stall(stuck(), 0.5):
            got.append(row)
    assert got == [1] and time.perf_counter() - t < 5
    hang.set()


def test_a_stalled_ray_job_stops_records_the_shards_still_out_and_exits_3(tmp_path, prompts, monkeypatch, capsys):
    """Ray Data's iterator hangs after the first shard (as it can after an actor restart on an oversubscribed
    machine): after stall_seconds the job stops, keeps the finished shard, records the others as failed and exits
    3; the next run retries only those."""
    import ray

    from pipelines.collect import job
    cfg = config(tmp_path, [prompts], stall_seconds=1.0)
    hang = threading.Event()

    class StuckDataset:                                              # the first shard, then nothing
        def __init__(self, cfg, contract, work):
            # made before the stall clock starts: on a busy machine one shard alone can take longer than 1 s
            self.rows = list(job.iter_inline(cfg, contract, work[:1]))

        def iter_rows(self):
            yield from self.rows
            hang.wait()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)         # no cluster: the dataset is the fake above
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(job, "build_dataset", StuckDataset)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert collect_main(["--config", str(path), "--no-progress"]) == 3
    hang.set()
    summary = json.loads(capsys.readouterr().out)
    m = read_manifest(cfg.output_dir)
    assert len(m["shards"]) == 1 and len(m["failed"]) == 2 == len(summary["failed"])
    assert all("no shard finished in 1 s (stall_seconds)" in e for e in m["failed"].values())
    assert m["complete"] is False and shard_files(cfg.output_dir) == sorted(m["shards"])
    summary = run(cfg, progress=False, use_ray=False)
    m = read_manifest(cfg.output_dir)
    assert summary["failed"] == {} and m["complete"] is True and len(m["shards"]) == 3
