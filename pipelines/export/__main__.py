"""Export a training run as a published artifact, and push it to the Hugging Face Hub.

  python -m pipelines.export --run runs/weaver --out artifacts/weaver                               # local folder
  python -m pipelines.export --run runs/weaver --out artifacts/weaver --repo-id org/name --push     # and the Hub
  python -m pipelines.export --run runs/drafter --model dflash --out artifacts/drafter              # a DFlash drafter
  python -m pipelines.export --run runs/weaver --out artifacts/weaver --format sglang-dflash-tfm     # + fork's file

The folder (config.json, model.safetensors, contract.json, README.md model card, provenance.json, an acceptance
plot) is checked before it is put in place: reloaded through tfm_runtime.load_adapter against the run's contract
and the target's and drafter's configs, its tensors against the run's. A failed check writes nothing and pushes
nothing. The push takes the token the Hub client finds (HF_TOKEN or `hf auth login`) and the endpoint it reads
(HF_ENDPOINT); pushing an unchanged artifact makes no commit.
Exit codes: 0 done, 2 bad input or a failed check (nothing written), 3 the push failed (the local artifact stays).
"""
from __future__ import annotations

import argparse
import sys


def parse(argv=None):
    from pipelines.export.config import CHECKPOINTS, FORMATS, MODELS, ExportConfig
    ap = argparse.ArgumentParser(prog="python -m pipelines.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="training run folder (pipelines.train's output_dir)")
    ap.add_argument("--out", required=True, help="artifact folder to write (an earlier export there is replaced)")
    ap.add_argument("--model", choices=MODELS, default="weaver",
                    help="what the run trained: weaver (default) or dflash (a DFlash drafter, z-lab layout)")
    ap.add_argument("--checkpoint", choices=CHECKPOINTS, default="final",
                    help="final (default) or best (by held-out simulated acceptance)")
    ap.add_argument("--format", choices=FORMATS, default="tfm",
                    help="sglang-dflash-tfm: also write the Weaver in the authors' SGLang fork layout (a torch file)")
    ap.add_argument("--eval", help="acceptance benchmark results for the card (python -m benchmarks.runtime.acceptance --out)")
    ap.add_argument("--target", help="local copy of the target to check against (default: the one in the contract)")
    ap.add_argument("--drafter", help="local copy of the DFlash drafter to check against (default: the contract's)")
    ap.add_argument("--repo-id", help="Hub repository org/name (names the card; needed by --push)")
    ap.add_argument("--push", action="store_true", help="push the folder to --repo-id after the checks")
    ap.add_argument("--private", action="store_true", help="create the repository private")
    ap.add_argument("--revision", help="Hub branch to push to (default main; created when missing)")
    ap.add_argument("--commit-message", help="commit message of the push")
    ap.add_argument("--license", default="apache-2.0", help="license in the card's metadata (default apache-2.0)")
    ap.add_argument("--dataset", action="append", default=[], dest="datasets",
                    help="Hub dataset id of the training prompts, for the card's metadata (repeatable)")
    a = ap.parse_args(argv)
    return ExportConfig(run=a.run, out=a.out, model=a.model, checkpoint=a.checkpoint, format=a.format,
                        repo_id=a.repo_id, push=a.push, private=a.private, revision=a.revision,
                        commit_message=a.commit_message, eval=a.eval, target=a.target, drafter=a.drafter,
                        license=a.license, datasets=a.datasets)


def main(argv=None) -> int:
    from pipelines.export.artifact import export
    from pipelines.export.hub import PushError

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        cfg = parse(argv)
        artifact = export(cfg, log=log)
    except PushError as e:
        log(f"error: {e} (the local artifact is complete and unchanged)")
        return 3
    except (ValueError, OSError) as e:                 # ContractError is a ValueError; nothing was written
        log(f"error: {e}")
        return 2
    if artifact.push is not None:
        p = artifact.push
        state = "new commit" if p.new_commit else "no change: the Hub already held these files"
        log(f"pushed {p.repo_id}@{p.revision}: commit {p.commit_sha} ({state}) {p.commit_url}")
        print(p.commit_sha)
    return 0


if __name__ == "__main__":
    sys.exit(main())
