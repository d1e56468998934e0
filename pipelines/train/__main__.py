"""Train Weaver (or a DFlash drafter) on collect's shards with DeepSpeed.

  python -m pipelines.train --config train.yaml                          # one process (GPU, or CPU with gloo)
  deepspeed --module pipelines.train --config train.yaml                 # every GPU of the machine
  torchrun --nproc_per_node 2 -m pipelines.train --config train.yaml     # the same through torchrun

The run folder (output_dir) gets train_config.json, metrics.jsonl, tb/, checkpoints/, best/, final/ and
summary.json. Running the same command again resumes from the last checkpoint. SIGTERM or SIGUSR1 (a
preempting scheduler) makes every rank checkpoint at the next step boundary and exit with code 143.
Exit code 2: bad config or data (refused before training), or `max_bad_steps` non-finite steps in a row (the
message names the step and its rows; the last checkpoint is kept).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML or JSON file with the TrainConfig fields")
    ap.add_argument("--output-dir", help="override config.output_dir (the run folder)")
    ap.add_argument("--data", nargs="+", help="override config.data (collect output folders)")
    ap.add_argument("--model", choices=["weaver", "dflash"], help="override config.model: train Weaver, or a "
                    "DFlash drafter (from collect's text_only shards) for a target that has none")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("tfm.train")
    from pipelines.train.config import TrainConfig
    try:
        cfg = TrainConfig.load(args.config)
        if args.output_dir:
            cfg.output_dir = args.output_dir
        if args.data:
            cfg.data = args.data
        if args.model:
            cfg.model = args.model
        from pipelines.train.loop import BadSteps, Stopped, train
        summary = train(cfg, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, BadSteps) as e:
        log.error("%s", e)
        return 2
    except Stopped as e:                                   # SIGTERM / SIGUSR1: preempted, checkpoint written
        log.warning("%s", e)
        return 143
    if rank == 0:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
