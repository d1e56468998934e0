"""python -m pipelines.recipe --recipe recipes/smollm2/recipe.yaml --work /data/smollm2

Runs a recipe: an ordered list of stages, each one of the project's own stages (prepare a GGUF target, write the
prompt sets, collect, train, export) with a config file beside the recipe. `{work}` in a config is the work
folder; the resolved configs are saved under <work>/configs/. A stage that finished is marked in <work>/done/ and
skipped on the next run; an unfinished one resumes (collect skips finished shards, train restarts from its last
checkpoint), so the recipe survives preemption and machines that only run for a few minutes at a time:

  python -m pipelines.recipe --recipe R --work W --deadline 540   # stop cleanly after 9 minutes (exit 3)

At the deadline, or when the driver itself gets SIGTERM or SIGINT (a preempting scheduler, Ctrl-C), the running
stage gets SIGTERM (train checkpoints at the next step and exits 143) and the recipe exits with code 3: run the same
command again to continue. `--until NAME` stops after stage NAME; `--only NAME` runs just that stage (its earlier
stages must be done). Export stages take the export's options as `args`. Exit codes: 0 all done, 2 bad recipe or
a stage failed, 3 stopped at the deadline or by a signal.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pipelines.config_io import checked_fields, load_mapping
from tfm_runtime.io import atomic_write_json, atomic_write_text

log = logging.getLogger("tfm.recipe")
KINDS = ("prepare", "prompts", "collect", "train", "export")
STOPPED = 3


@dataclass
class Stage:
    name: str
    kind: str                               # prepare | prompts | collect | train | export
    config: str | None = None               # collect/train: a config file beside the recipe
    args: dict = field(default_factory=dict)   # prepare: {spec, out, dtype}; prompts: {out, max_chars, limit};
                                               # export: its command-line options ({run, out, model, ...})

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"recipe stage {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("collect", "train") and not self.config:
            raise ValueError(f"recipe stage {self.name!r} ({self.kind}) needs a config file")
        if self.kind == "export" and not {"run", "out"} <= set(self.args):
            raise ValueError(f"recipe stage {self.name!r} (export) needs args with run and out")


@dataclass
class Recipe:
    stages: list[Stage]
    description: str = ""
    folder: str = "."

    @classmethod
    def load(cls, path: str) -> "Recipe":
        d = checked_fields(cls, {**load_mapping(path, "recipe"), "folder": os.path.dirname(os.path.abspath(path))},
                           "recipe")
        stages = [Stage(**checked_fields(Stage, s, f"recipe stage {i}")) for i, s in enumerate(d["stages"])]
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"recipe {path}: stage names must be unique, got {names}")
        for s in stages:
            if s.config and not os.path.isfile(os.path.join(d["folder"], s.config)):
                raise FileNotFoundError(f"recipe {path}: stage {s.name!r} config {s.config!r} does not exist")
        return cls(stages=stages, description=d.get("description", ""), folder=d["folder"])


def resolve(text: str, work: str) -> str:
    return text.replace("{work}", work)


def stage_command(stage: Stage, recipe: Recipe, work: str, extra: dict[str, list[str]]) -> list[str]:
    """The command line that runs `stage` (its config resolved into <work>/configs/)."""
    py = [sys.executable, "-m"]
    if stage.kind == "prepare":
        a = {k: resolve(str(v), work) for k, v in stage.args.items()}
        return py + ["pipelines.recipe.prepare", "--spec", a["spec"], "--out", a["out"],
                     "--dtype", a.get("dtype", "bfloat16")]
    if stage.kind == "prompts":
        a = {k: resolve(str(v), work) for k, v in stage.args.items()}
        cmd = py + ["pipelines.prompts", "--out", a["out"]]
        for k in ("max_chars", "limit"):
            if k in a:
                cmd += ["--" + k.replace("_", "-"), a[k]]
        return cmd
    if stage.kind == "export":
        cmd = py + ["pipelines.export"]
        for k, v in stage.args.items():
            flag = "--" + k.replace("_", "-")
            cmd += [flag] if v is True else [] if v is False else [flag, resolve(str(v), work)]
        return cmd + extra.get("export", [])
    with open(os.path.join(recipe.folder, stage.config)) as f:
        text = resolve(f.read(), work)
    path = os.path.join(work, "configs", f"{stage.name}{os.path.splitext(stage.config)[1]}")
    atomic_write_text(path, text)
    return py + [f"pipelines.{stage.kind}", "--config", path, *extra.get(stage.kind, [])]


class StopRequest:
    """Why the recipe should stop now, if it should: the deadline passed or the driver got SIGTERM/SIGINT."""

    def __init__(self, deadline_s: float | None = None):
        self.deadline = time.time() + deadline_s if deadline_s else None
        self.signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name

    def reason(self) -> str | None:
        if self.signal:
            return self.signal
        if self.deadline is not None and time.time() >= self.deadline:
            return "the deadline"
        return None


def run_stage(cmd: list[str], stop: StopRequest, log_path: str) -> int:
    """Run `cmd`, its output teed to the console and `log_path` as it comes (progress bars included); when `stop`
    says so (deadline or signal), send the stage SIGTERM, wait for it and return STOPPED."""
    with open(log_path, "ab") as logf:
        logf.write(f"\n$ {' '.join(cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        termed = False
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:                 # nothing to read now
                chunk = None
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                logf.write(chunk)
                continue
            if chunk == b"" or proc.poll() is not None:   # end of output, or the stage exited and all it wrote is read
                proc.wait()
                break
            if not termed and stop.reason():
                log.warning("%s: stopping the stage (SIGTERM)", stop.reason())
                proc.send_signal(signal.SIGTERM)
                termed = True
            time.sleep(0.2)
        return STOPPED if termed and proc.returncode != 0 else proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.recipe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="recipe YAML (stages and their config files)")
    ap.add_argument("--work", required=True, help="work folder: models, prompts, shards, runs, logs")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from now to stop cleanly (exit 3); SIGTERM or SIGINT stops the same way")
    ap.add_argument("--until", help="stop after this stage")
    ap.add_argument("--only", help="run only this stage (the ones before it must be done)")
    ap.add_argument("--collect-args", default="", help="extra arguments for collect stages (e.g. --no-ray)")
    ap.add_argument("--train-args", default="", help="extra arguments for train stages")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        recipe = Recipe.load(args.recipe)
        names = [s.name for s in recipe.stages]
        for opt in ("until", "only"):
            if getattr(args, opt) and getattr(args, opt) not in names:
                raise ValueError(f"--{opt} {getattr(args, opt)!r}: the recipe's stages are {names}")
    except (ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    work = os.path.abspath(args.work)
    os.makedirs(os.path.join(work, "done"), exist_ok=True)
    stop = StopRequest(args.deadline)
    stop.install()
    extra = {"collect": args.collect_args.split(), "train": args.train_args.split()}
    for stage in recipe.stages:
        marker = os.path.join(work, "done", stage.name + ".json")
        if args.only and stage.name != args.only:
            if names.index(stage.name) < names.index(args.only) and not os.path.isfile(marker):
                log.error("--only %s: stage %s before it is not done", args.only, stage.name)
                return 2
            continue
        if os.path.isfile(marker):
            log.info("stage %s: done before, skipped", stage.name)
        else:
            if stop.reason():
                log.warning("stopped by %s before stage %s: run the same command again to continue", stop.reason(),
                            stage.name)
                return STOPPED
            cmd = stage_command(stage, recipe, work, extra)
            log.info("stage %s: %s", stage.name, " ".join(cmd[2:]))
            t0 = time.time()
            rc = run_stage(cmd, stop, os.path.join(work, "recipe.log"))
            if rc in (STOPPED, 143):
                log.warning("stage %s stopped by %s after %.0f s: run the same command again to continue",
                            stage.name, stop.reason() or "SIGTERM", time.time() - t0)
                return STOPPED
            if rc != 0:
                log.error("stage %s failed (exit %d); its output is in %s", stage.name, rc,
                          os.path.join(work, "recipe.log"))
                return 2
            atomic_write_json(marker, {"stage": stage.name, "seconds": round(time.time() - t0, 1),
                                       "command": cmd[2:], "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())})
            log.info("stage %s: finished in %.0f s", stage.name, time.time() - t0)
        if stage.name in (args.until, args.only):
            break
    print(json.dumps({"work": work, "done": sorted(os.listdir(os.path.join(work, "done")))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
