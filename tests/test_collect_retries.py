"""The collect job on a local Ray: a shard whose stage raises is retried, an actor whose process dies is restarted
and its shard retried, and a shard that keeps failing is recorded while the others complete; the next run (in process here)
collects only that one. Failures are injected into the Ray workers by tests/collect_faults.py."""
from __future__ import annotations

import json
import logging
import os

import pytest

from pipelines.collect.__main__ import run
from pipelines.collect.config import CollectConfig
from pipelines.shards import read_manifest

# serial: alone after the parallel tests; with the CPU oversubscribed, the restart of the killed actor can stall
# Ray Data's iterator for minutes (seen in CI, and here with four busy processes beside it)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def fault_plan(tmp_path_factory):
    """A local Ray whose workers run tests/collect_faults.py; -> the plan file (empty: no faults)."""
    import ray
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    plan.write_text("{}")
    env = {"PYTHONPATH": os.pathsep.join([TESTS, REPO]), "TFM_TEST_FAULT_PLAN": str(plan),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING,
             runtime_env={"worker_process_setup_hook": "collect_faults.install", "env_vars": env})
    yield plan
    ray.shutdown()


def test_ray_job_retries_raising_and_dying_shards_and_records_what_still_fails(fault_plan, tmp_path):
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": f"answer number {i}, in words."}]}) + "\n")
    cfg = CollectConfig(target="tiny:llama:0", drafter="tiny:llama:0", inputs=[str(chats)],
                        output_dir=str(tmp_path / "out"), response="keep", anchors_per_sequence=2, candidate_pool=8,
                        target_topk=4, samples_per_shard=2, max_prompt_tokens=64, shard_retries=2,
                        stall_seconds=300)                       # a hung Ray Data pool fails here, not at the timeout
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    fault_plan.write_text(json.dumps({"dir": str(attempts), "samples_per_shard": 2, "1": "raise_once",
                                      "2": "die_once", "3": "raise_always"}))
    summary = run(cfg, progress=False, use_ray=True)
    m = read_manifest(cfg.output_dir)
    names = [f"shard-{k:05d}-{m['config_hash']}.parquet" for k in range(4)]
    tries = {p.name: len(p.read_text().splitlines()) for p in attempts.iterdir()}
    assert tries == {"1": 2, "2": 2, "3": 3}, tries               # retried in place / after a restart / given up
    assert list(summary["failed"]) == [names[3]] and list(m["failed"]) == [names[3]]
    assert "RuntimeError: injected failure in shard 3" in m["failed"][names[3]]
    assert sorted(m["shards"]) == names[:3] and m["complete"] is False
    assert sorted(f for f in os.listdir(cfg.output_dir) if f.endswith(".parquet")) == names[:3]
    kept = {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in names[:3]}

    fault_plan.write_text("{}")                                     # the cause is gone: the next run completes
    summary = run(cfg, progress=False, use_ray=False)
    m = read_manifest(cfg.output_dir)
    assert summary["failed"] == {} and m["failed"] == {} and m["complete"] is True
    assert sorted(m["shards"]) == names
    assert {n: os.stat(os.path.join(cfg.output_dir, n)).st_mtime_ns for n in kept} == kept   # not redone
