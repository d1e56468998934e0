"""Failure injection into collect's Ray workers, for tests only: Ray runs `install` in every worker process it
starts (runtime_env `worker_process_setup_hook`), which wraps `pipelines.collect.job.featurize_batch`.

The plan is the JSON file named by TFM_TEST_FAULT_PLAN, read at every call, so a test can change it between runs:
{"dir": folder for the attempt logs, "samples_per_shard": n, "<shard index>": "raise_once" | "die_once" |
"raise_always"}. Each call on a planned shard appends a line to <dir>/<shard index>.
"""
import json
import os


def install() -> None:
    from pipelines.collect import job
    real = job.featurize_batch

    def featurize_batch(target, drafter, samples, **kw):
        with open(os.environ["TFM_TEST_FAULT_PLAN"]) as f:
            plan = json.load(f)
        k = str(samples[0].sample_id // plan.get("samples_per_shard", 1))
        mode = plan.get(k)
        if mode:
            log = os.path.join(plan["dir"], k)
            first = not os.path.exists(log)
            with open(log, "a") as f:
                f.write("attempt\n")
            if mode == "raise_always" or (mode == "raise_once" and first):
                raise RuntimeError(f"injected failure in shard {k}")
            if mode == "die_once" and first:
                os._exit(1)                                  # the actor's process dies, as under the OOM killer
        return real(target, drafter, samples, **kw)

    job.featurize_batch = featurize_batch
