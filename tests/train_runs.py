"""Runs `python -m pipelines.train`'s main on each config given, in turn, in this one interpreter: torch, DeepSpeed and
transformers are imported once for all the runs (a process start costs more than a short run). After each run a line
`@@ exit <code>` goes to stderr; the first run that fails ends the process with its code. Under the deepspeed
launcher every rank runs the configs in the same order (the launcher's --local_rank argument is dropped).

  python tests/train_runs.py A.json B.json                  deepspeed --num_gpus 2 tests/train_runs.py A.json B.json
"""
import sys

from pipelines.train.__main__ import main

SEPARATOR = "@@ exit "


def split_outputs(stderr: str) -> list[tuple[int, str]]:
    """The (exit code, stderr) of each run, from the stderr of all of them."""
    parts = stderr.split(SEPARATOR)
    return [(int(nxt.split(None, 1)[0]), out) for out, nxt in zip(parts, parts[1:])]


if __name__ == "__main__":
    for config in [a for a in sys.argv[1:] if not a.startswith("--local_rank")]:
        rc = main(["--config", config, "--no-progress"])
        print(f"{SEPARATOR}{rc}", file=sys.stderr, flush=True)
        if rc:
            sys.exit(rc)
