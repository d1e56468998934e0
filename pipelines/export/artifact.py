"""The published artifact: which files a folder holds, how they are made from a training run, and the checks that
run before the folder is put in place or pushed.

A Weaver adapter:
  config.json            the Weaver config (+ "tfm": the step and checkpoint it came from)
  model.safetensors      the run's weights, byte for byte
  contract.json          the run's contract: target, drafter, sizes, taps, block, mask token, K, L, tokenizer hash
  README.md              the model card (YAML metadata, requirements, use, SGLang command, training, evaluation)
  acceptance_by_depth.png  held-out per-depth acceptance, Weaver against DFlash
  provenance.json        code revision, package versions, this export's config, the training config's hash, the
                         data manifests' fingerprints and the sha256 of every other file
  sglang_dflash_tfm.pt   only with format sglang-dflash-tfm: the Weaver in the authors' SGLang fork layout
A DFlash drafter: config.json (z-lab layout; dflash_config also holds block_size and num_target_layers, which
SGLang reads there first), model.safetensors, README.md, acceptance_by_depth.png, provenance.json.

The folder is built in a temp folder beside `out`, reloaded and checked (`tfm_runtime.load_adapter` against the
run's contract and the target and drafter configs, the tensors against the run's, the SGLang tables), and only then
renamed into place: a failed export leaves no folder and an existing artifact untouched, and nothing is pushed.
Nothing in it depends on the time or the host, so exporting an unchanged run again gives the same bytes.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass

import torch

from pipelines.export.card import PLOT, CardInfo, acceptance_plot, dflash_card, weaver_card
from pipelines.export.config import ExportConfig
from pipelines.export.hub import PUSH_RECORD, PushResult, push
from pipelines.export.run import RunFolder, read_run
from pipelines.export.sglang import FORK_FILE, check_sglang_dflash, write_fork_checkpoint
from pipelines.provenance import PACKAGES, file_sha256, git_revision, package_versions
from tfm_runtime.contract import ContractError, check_compatible, tokenizer_hash
from tfm_runtime.loading import ModelSpec, load_drafter_config, load_tokenizer, target_config
from tfm_runtime.models.common import load_safetensors_dir, read_safetensors_header

PROVENANCE = "provenance.json"
EXPORT_FORMAT = 1
BENCH_FIELDS = ("dataset", "proposal", "budget", "temperature", "verification", "acceptance_length", "mean_tree_size")
CHECKED = {"weaver": "the run's tensors and contract, the target's config and tokenizer, the drafter's config",
           "dflash": "the run's tensors, the target's config and tokenizer, SGLang's DFlash table"}


@dataclass
class Artifact:
    path: str
    kind: str                         # weaver | dflash
    files: dict[str, dict]            # name -> {"bytes", "sha256"} (provenance.json lists the others)
    push: PushResult | None = None


def export(cfg: ExportConfig, log=print) -> Artifact:
    """Build, check and place the artifact of `cfg.run`, then push it if asked. Raises FileNotFoundError,
    ValueError or ContractError before anything is placed or pushed, PushError if the push fails (the local
    artifact stays)."""
    _check_out(cfg.out)
    run = read_run(cfg.run, cfg.model, cfg.checkpoint)
    log(f"run {run.path}: {run.model}, {run.checkpoint}/ at step {run.step}")
    bench = read_bench(cfg.eval) if cfg.eval else None
    out = os.path.abspath(cfg.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=os.path.dirname(out))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)                     # mkdtemp makes 0700; the artifact gets a normal mode
    try:
        build = build_weaver if run.model == "weaver" else build_dflash
        target, drafter = build(tmp, cfg, run, bench)
        files = write_provenance(tmp, cfg, run, target, drafter)
        check_provenance(tmp)
        _place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, f in files.items():
        log(f"  {name:<26} {f['bytes']:>12,} B  sha256 {f['sha256'][:16]}")
    log(f"wrote {cfg.out}: {len(files) + 1} files, reloaded and checked against {CHECKED[run.model]}")
    artifact = Artifact(path=cfg.out, kind=run.model, files=files)
    if cfg.push:
        artifact.push = push(cfg.out, cfg.repo_id, private=cfg.private, revision=cfg.revision,
                             commit_message=cfg.commit_message)
    return artifact


# ---- Weaver ----------------------------------------------------------------------------------------------------
def build_weaver(tmp: str, cfg: ExportConfig, run: RunFolder, bench: dict | None):
    """Write a Weaver artifact into `tmp` and check it; -> (target spec, drafter spec)."""
    from tfm_runtime.hub import load_adapter
    from tfm_runtime.models.weaver import WeaverConfig
    c = run.contract
    target = _spec(cfg.target, run.train_config.get("target"), c.target_id, c.target_revision)
    drafter = _spec(cfg.drafter, None, c.drafter_id, c.drafter_revision)
    with open(os.path.join(run.folder, "config.json")) as f:
        wcfg = WeaverConfig.from_dict(json.load(f))
    shutil.copyfile(os.path.join(run.folder, "model.safetensors"), os.path.join(tmp, "model.safetensors"))
    shutil.copyfile(os.path.join(run.folder, "contract.json"), os.path.join(tmp, "contract.json"))
    _write_json(os.path.join(tmp, "config.json"),
                {**wcfg.to_dict(), "tfm": {"step": run.step, "checkpoint": run.checkpoint}})
    _, state = load_safetensors_dir(run.folder)
    sglang = None
    if cfg.format == "sglang-dflash-tfm":
        write_fork_checkpoint(os.path.join(tmp, FORK_FILE), state, wcfg)
        sglang = FORK_FILE
    ev = run.eval
    acceptance_plot(os.path.join(tmp, PLOT), {"Weaver": ev["top1_weaver_by_depth"],
                                              "DFlash": ev["top1_dflash_by_depth"]},
                    f"held-out acceptance by depth, step {run.step}")
    info = _card_info(cfg, run, ModelSpec(c.target_id, c.target_revision), ModelSpec(c.drafter_id, c.drafter_revision),
                      state, bench, sglang)                   # the card names the contract's models, not local copies
    _write_text(os.path.join(tmp, "README.md"), weaver_card(info))

    # the checks: the folder through the runtime's own loader, against the target's and drafter's configs
    where = f"exported adapter ({run.checkpoint}/ of {run.path})"
    adapter = load_adapter(tmp, target=_target_config(target), drafter=_drafter_config(drafter),
                           dtype=_saved_dtype(state))                          # bf16 from a GPU run stays bf16
    _check_tokenizer(c, target, where)
    check_compatible(c, adapter.contract, strict_ids=True, where=where)
    if adapter.contract.to_dict() != c.to_dict():
        raise ValueError(f"{where}: contract.json differs from the run's")
    _same_tensors(adapter.state_dict(), state, where)
    _check_card(os.path.join(tmp, "README.md"))
    return target, drafter


# ---- DFlash drafter --------------------------------------------------------------------------------------------
def build_dflash(tmp: str, cfg: ExportConfig, run: RunFolder, bench: dict | None):
    """Write a DFlash drafter artifact (z-lab layout) into `tmp` and check it; -> (target spec, None)."""
    from tfm_runtime.models.dflash import DFlashDrafter
    with open(os.path.join(run.folder, "config.json")) as f:
        config = json.load(f)
    c = run.contract
    target = _spec(cfg.target, run.train_config.get("target"), c.target_id if c else _trained_for(run),
                   c.target_revision if c else None)
    # SGLang reads these from dflash_config first (z-lab keeps them top-level too; both agree)
    config["dflash_config"] = {**config["dflash_config"], "block_size": config["block_size"],
                               "num_target_layers": config["num_target_layers"]}
    _write_json(os.path.join(tmp, "config.json"), config)
    shutil.copyfile(os.path.join(run.folder, "model.safetensors"), os.path.join(tmp, "model.safetensors"))
    _, state = load_safetensors_dir(run.folder)
    acceptance_plot(os.path.join(tmp, PLOT), {"DFlash": run.eval["top1_by_position"]},
                    f"held-out acceptance by block position, step {run.step}")
    info = _card_info(cfg, run, ModelSpec(c.target_id, c.target_revision) if c else target, None, state, bench)
    _write_text(os.path.join(tmp, "README.md"), dflash_card(info, config))

    where = f"exported DFlash drafter ({run.checkpoint}/ of {run.path})"
    drafter = DFlashDrafter.from_pretrained(tmp, dtype=_saved_dtype(state))
    _same_tensors(drafter.state_dict(), state, where)
    check_sglang_dflash(config, read_safetensors_header(os.path.join(tmp, "model.safetensors")))
    tc, dc = _target_config(target), drafter.cfg
    pairs = [("vocab_size", tc.vocab_size, dc.vocab_size), ("target_hidden_size", tc.hidden_size, dc.hidden_size),
             ("num_target_layers", tc.num_hidden_layers, dc.num_target_layers)]
    if c is not None:
        pairs.append(("mask_token_id", c.mask_token_id, dc.mask_token_id))
    for name, expected, actual in pairs:
        if expected != actual:
            raise ContractError(name, expected, actual, f"{where} vs target {target.path}")
    if c is not None:
        _check_tokenizer(c, target, where)
    _check_card(os.path.join(tmp, "README.md"))
    return target, None


# ---- provenance --------------------------------------------------------------------------------------------------
def write_provenance(tmp: str, cfg: ExportConfig, run: RunFolder, target: ModelSpec,
                     drafter: ModelSpec | None) -> dict[str, dict]:
    """provenance.json, written last: -> {file: {"bytes", "sha256"}} of every other file."""
    files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "sha256": file_sha256(os.path.join(tmp, name))}
             for name in sorted(os.listdir(tmp))}
    record = {"tfm_export": EXPORT_FORMAT, "kind": run.model,
              "code": {"git_revision": git_revision(), "python": platform.python_version(),
                       "packages": package_versions(PACKAGES + ("matplotlib",))},
              "export_config": cfg.to_dict(),
              "run": {"path": os.path.abspath(run.path), "checkpoint": run.checkpoint, "step": run.step,
                      "run_hash": run.train_config.get("run_hash"),
                      "train_config_sha256": file_sha256(os.path.join(run.path, "train_config.json"))},
              "data": run.data,
              "eval": {"path": cfg.eval, "sha256": file_sha256(cfg.eval)} if cfg.eval else None,
              "target": asdict(target), "drafter": asdict(drafter) if drafter else None,
              "files": files}
    _write_json(os.path.join(tmp, PROVENANCE), record)
    return files


def check_provenance(folder: str) -> None:
    """Every file of the folder is listed in provenance.json with its size and sha256, and nothing else is."""
    with open(os.path.join(folder, PROVENANCE)) as f:
        listed = json.load(f)["files"]
    present = sorted(n for n in os.listdir(folder) if n not in (PROVENANCE, PUSH_RECORD))
    if sorted(listed) != present:
        raise ValueError(f"{folder}: provenance.json lists {sorted(listed)}, the folder holds {present}")
    for name, facts in listed.items():
        if file_sha256(os.path.join(folder, name)) != facts["sha256"]:
            raise ValueError(f"{folder}/{name}: sha256 differs from provenance.json")


# ---- helpers -----------------------------------------------------------------------------------------------------
def read_bench(path: str) -> dict:
    """Acceptance benchmark results (`python -m benchmarks.runtime.acceptance --out`): {"env", "world", "rows"}."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--eval file {path!r} does not exist")
    with open(path) as f:
        try:
            bench = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--eval file {path}: not valid JSON ({e})") from e
    rows = bench.get("rows") if isinstance(bench, dict) else None
    if not rows or not all(isinstance(r, dict) and all(k in r for k in BENCH_FIELDS) for r in rows):
        raise ValueError(f"--eval file {path}: expected {{'rows': [...]}} with fields {list(BENCH_FIELDS)} in "
                         f"every row (benchmarks.runtime.acceptance --out writes it)")
    return bench


def _check_out(out: str) -> None:
    """`out` may be new, or an earlier export (replaced on success); anything else is refused before any work."""
    if not os.path.exists(out):
        return
    prov = os.path.join(out, PROVENANCE)
    try:
        with open(prov) as f:
            ok = os.path.isdir(out) and "tfm_export" in json.load(f)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise FileExistsError(f"--out {out} exists and is not an export artifact (no provenance.json written by "
                              f"pipelines.export): choose another folder or remove it")


def _place(tmp: str, out: str) -> None:
    """Rename the finished folder into place; an earlier artifact at `out` is swapped out and then removed."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = tmp + ".old"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _spec(override: str | None, trained: dict | str | None, contract_id: str, revision: str | None) -> ModelSpec:
    """The model to check against: the --target/--drafter override, else what training loaded, else the contract's."""
    if override:
        return ModelSpec(override)
    return ModelSpec.of(trained) or ModelSpec(contract_id, revision)


def _card_info(cfg: ExportConfig, run: RunFolder, target: ModelSpec, drafter: ModelSpec | None, state: dict,
               bench: dict | None, sglang_file: str | None = None) -> CardInfo:
    """The card's facts: titled and loaded by the repository id, or by the folder when there is none."""
    return CardInfo(name=cfg.repo_id or os.path.basename(os.path.abspath(cfg.out)), load_id=cfg.repo_id or cfg.out,
                    hub=cfg.repo_id is not None, run=run, target=target, drafter=drafter, license=cfg.license,
                    datasets=cfg.datasets, parameters=sum(t.numel() for t in state.values()), bench=bench,
                    sglang_file=sglang_file)


def _trained_for(run: RunFolder) -> str:
    with open(os.path.join(run.folder, "tfm_train.json")) as f:
        target = json.load(f).get("target")
    if not target:
        raise ValueError(f"{run.folder}/tfm_train.json does not name the target; pass --target")
    return target


def _target_config(spec: ModelSpec):
    try:
        return target_config(spec)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot read the target's config to check the artifact against ({e}); pass "
                                f"--target with a local copy") from e


def _check_tokenizer(contract, spec: ModelSpec, where: str) -> None:
    """The target's tokenizer hashes to the contract's tokenizer_hash (when the contract records one)."""
    if contract.tokenizer_hash is None:
        return
    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot read the target's tokenizer to check the artifact against ({e}); pass "
                                f"--target with a local copy") from e
    if tokenizer_hash(tok) != contract.tokenizer_hash:
        raise ContractError("tokenizer_hash", contract.tokenizer_hash, tokenizer_hash(tok),
                            f"{where} vs the tokenizer of {spec.path}")


def _drafter_config(spec: ModelSpec):
    """The DFlash drafter's config; for a Hub id only its config.json is fetched."""
    from tfm_runtime.hub import is_local
    from tfm_runtime.models.dflash import DFlashConfig
    try:
        if spec.tiny or is_local(spec.path):
            return load_drafter_config(spec)
        from huggingface_hub import hf_hub_download
        with open(hf_hub_download(spec.path, "config.json", revision=spec.revision)) as f:
            return DFlashConfig.from_hf_dict(json.load(f))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot read the drafter's config to check the artifact against ({e}); pass "
                                f"--drafter with a local copy") from e


def _saved_dtype(state: dict) -> torch.dtype:
    """The floating dtype the run saved its tensors in (the reload must not convert them)."""
    return next(v.dtype for v in state.values() if v.is_floating_point())


def _same_tensors(loaded: dict, saved: dict, where: str) -> None:
    if set(loaded) != set(saved):
        raise ValueError(f"{where}: reloaded tensors {sorted(set(loaded) ^ set(saved))[:8]} differ from the run's")
    for k, v in saved.items():
        if loaded[k].dtype != v.dtype or not torch.equal(loaded[k], v):
            raise ValueError(f"{where}: reloaded tensor {k} differs from the run's")


def _check_card(path: str) -> None:
    from huggingface_hub import ModelCard
    card = ModelCard.load(path)
    if card.data.library_name != "tfm" or not card.data.tags:
        raise ValueError(f"{path}: the card's metadata did not parse back (library_name {card.data.library_name!r})")


def _write_json(path: str, obj) -> None:
    _write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
