"""A training run folder as export reads it: only its files (train_config.json, metrics.jsonl, final/ or best/, and
the manifests of the data folders it names), never the trainer's code.

  train_config.json   the resolved TrainConfig, its run_hash and provenance
  metrics.jsonl       one line per logged step; "kind": "eval" lines hold the held-out evaluation
  final/, best/       Weaver: config.json (+ "tfm": {"step"}), model.safetensors, contract.json
                      DFlash: config.json (z-lab layout), model.safetensors, tfm_train.json ({"step", "target"})
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pipelines.provenance import file_sha256
from tfm_runtime.contract import Contract

REQUIRED = {"weaver": ("config.json", "model.safetensors", "contract.json"),
            "dflash": ("config.json", "model.safetensors", "tfm_train.json")}
# what the card and the plot read from the evaluation at the checkpoint's step
EVAL_KEYS = {"weaver": ("top1_weaver_by_depth", "top1_dflash_by_depth", "hit_rate_by_depth", "accept_chain_weaver",
                        "accept_chain_dflash"),
             "dflash": ("top1_by_position", "accept_chain")}


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


@dataclass
class RunFolder:
    path: str
    model: str                   # weaver | dflash
    train_config: dict           # train_config.json
    checkpoint: str              # final | best
    folder: str                  # path/checkpoint: the model files
    step: int                    # the optimizer step the checkpoint was saved at
    eval: dict                   # the metrics.jsonl evaluation at `step`
    contract: Contract | None    # Weaver: the checkpoint's contract.json; DFlash: its data's (None if unreadable)
    data: list[dict]             # per data folder: path, manifest sha256, config hash, rows, shards, mode

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))


def read_run(path: str, model: str, checkpoint: str = "final") -> RunFolder:
    """Check that `path` is a finished `model` run and read what an export needs. Errors name the file and what is
    wrong: no such folder, not a run folder, a run of the other model type, a missing or incomplete checkpoint,
    no evaluation at the checkpoint's step."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"run folder {path!r} does not exist")
    cfg_path = os.path.join(path, "train_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} is not a training run folder: no train_config.json")
    train_config = _json(cfg_path)
    trained = train_config.get("model", "weaver")
    if trained != model:
        raise ValueError(f"wrong model type: {cfg_path} says model {trained!r}, this export expects {model!r} "
                         f"(export it with --model {trained})")
    folder = os.path.join(path, checkpoint)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"incomplete run: {folder} is missing ({checkpoint}/ is written when the run "
                                f"{'finishes' if checkpoint == 'final' else 'first evaluates'})")
    missing = [f for f in REQUIRED[model] if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise FileNotFoundError(f"incomplete run: {folder} lacks {missing}")
    config = _json(os.path.join(folder, "config.json"))
    if model == "weaver":
        if config.get("architecture", "Weaver") != "Weaver":
            raise ValueError(f"wrong model type: {folder}/config.json is not a Weaver config "
                             f"(architecture {config.get('architecture')!r})")
        step = (config.get("tfm") or {}).get("step")
        contract = Contract.load(os.path.join(folder, "contract.json"))
    else:
        if "DFlashDraftModel" not in (config.get("architectures") or []):
            raise ValueError(f"wrong model type: {folder}/config.json is not a DFlash drafter config "
                             f"(architectures {config.get('architectures')!r})")
        step = _json(os.path.join(folder, "tfm_train.json")).get("step")
        contract = None
    if not isinstance(step, int):
        raise ValueError(f"incomplete run: {folder} does not record the step it was saved at")
    evals = _evaluations(path)
    at_step = [e for e in evals if e["step"] == step]
    if not at_step:
        raise ValueError(f"incomplete run: {path}/metrics.jsonl has no evaluation at step {step} (the step "
                         f"{checkpoint}/ was saved at); evaluated steps: {[e['step'] for e in evals]}")
    lacks = [k for k in EVAL_KEYS[model] if k not in at_step[-1]]
    if lacks:
        raise ValueError(f"{path}/metrics.jsonl: the evaluation at step {step} lacks {lacks}")
    data = [_data_folder(d) for d in train_config.get("data") or []]
    if contract is None:                      # a DFlash run: the contract of the text-only shards it trained on
        contract = next((Contract.from_dict(d["contract"]) for d in data if d.get("contract")), None)
    return RunFolder(path=path, model=model, train_config=train_config, checkpoint=checkpoint, folder=folder,
                     step=step, eval=at_step[-1], contract=contract, data=data)


def _evaluations(path: str) -> list[dict]:
    mpath = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(mpath):
        raise FileNotFoundError(f"incomplete run: {path} has no metrics.jsonl")
    out = []
    with open(mpath) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{mpath}: line {i} is not valid JSON ({e})") from e
            if row.get("kind") == "eval":
                out.append(row)
    return out


def _data_folder(folder: str) -> dict:
    """The fingerprint of one collect output folder: its manifest's sha256, config hash, rows and shards (the
    manifest lists each shard's sha256). A folder that is gone is recorded as such."""
    mpath = os.path.join(folder, "manifest.json")
    if not os.path.isfile(mpath):
        return {"path": folder, "manifest_sha256": None, "note": "manifest.json not found at export time"}
    manifest = _json(mpath)
    shards = manifest.get("shards") or {}
    return {"path": folder, "manifest_sha256": file_sha256(mpath), "config_hash": manifest.get("config_hash"),
            "mode": manifest.get("mode", "anchors"), "shards": len(shards),
            "rows": sum(s.get("rows", 0) for s in shards.values()), "inputs": manifest.get("inputs"),
            "contract": manifest.get("contract")}
