"""Typed configuration of an export: which run and checkpoint, where the artifact goes, and where it is pushed.
Validated before any work and saved in the artifact's provenance.json."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

MODELS = ("weaver", "dflash")
CHECKPOINTS = ("final", "best")
FORMATS = ("tfm", "sglang-dflash-tfm")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ExportConfig:
    run: str                              # a training run folder (pipelines.train's output_dir)
    out: str                              # the artifact folder (replaced atomically when it holds an earlier export)
    model: str = "weaver"                 # what the run trained (its train_config.json "model"): weaver | dflash
    checkpoint: str = "final"             # final | best (by held-out simulated acceptance)
    format: str = "tfm"                   # sglang-dflash-tfm: also the Weaver in the authors' SGLang fork layout
    repo_id: str | None = None            # Hub repository org/name (the card's name; required by push)
    push: bool = False
    private: bool = False                 # a new repository is created private
    revision: str | None = None           # the Hub branch to push to (default main; created when missing)
    commit_message: str | None = None
    eval: str | None = None               # acceptance benchmark results (python -m benchmarks.runtime.acceptance --out)
    target: str | None = None             # a local copy of the target to validate against (default: the contract's)
    drafter: str | None = None            # the same for the DFlash drafter (Weaver exports)
    license: str = "apache-2.0"
    datasets: list[str] = field(default_factory=list)    # Hub dataset ids of the training prompts, for the card

    def __post_init__(self):
        checks = [("model", self.model in MODELS, f"one of {MODELS}"),
                  ("checkpoint", self.checkpoint in CHECKPOINTS, f"one of {CHECKPOINTS}"),
                  ("format", self.format in FORMATS, f"one of {FORMATS}"),
                  ("format", self.format == "tfm" or self.model == "weaver",
                   "'tfm' for a DFlash drafter (sglang-dflash-tfm is the Weaver layout of the authors' fork)"),
                  ("repo_id", self.repo_id is None or bool(REPO_ID.match(self.repo_id)), "of the form org/name"),
                  ("repo_id", self.repo_id is not None or not self.push, "given to push (--repo-id org/name)")]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"export config: {name} must be {expected}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
