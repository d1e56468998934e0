"""The recipe driver: stages in order from configs, done markers, a deadline that stops cleanly, resume, refusals."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = """
stages:
  - {name: shards, kind: collect, config: collect.yaml}
  - {name: weaver, kind: train, config: train.yaml}
  - {name: artifact, kind: export, args: {run: "{work}/run", out: "{work}/artifact"}}
"""


def _driver(*args):
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "pipelines.recipe", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _write_recipe(folder, steps=300):
    folder.mkdir()
    (folder / "recipe.yaml").write_text(RECIPE)
    with open(os.path.join(ROOT, "configs", "collect_tiny.yaml")) as f:
        collect = f.read().replace("/tmp/tfm-collect-tiny", "{work}/shards")
    with open(os.path.join(ROOT, "configs", "train_tiny.yaml")) as f:
        train = f.read().replace("[/tmp/tfm-collect-tiny]", '["{work}/shards"]').replace("/tmp/tfm-train-tiny",
                                                                                          "{work}/run")
    train = train.replace("steps: 60", f"steps: {steps}").replace("checkpoint_every: 30", "checkpoint_every: 10")
    (folder / "collect.yaml").write_text(collect)
    (folder / "train.yaml").write_text(train)
    return str(folder / "recipe.yaml")


@pytest.mark.slow
def test_a_signal_stops_cleanly_and_the_same_command_resumes_to_the_end(tmp_path):
    """SIGTERM to the driver (what a preempting scheduler or the deadline does) stops training at a checkpoint with
    exit 3; the same command resumes from it. The signal goes once training has checkpointed (step 10), so the test
    does not race the machine's speed; 90 more steps (about 5 s here) leave the signal ample time to arrive."""
    recipe, work = _write_recipe(tmp_path / "r", steps=100), str(tmp_path / "work")
    r = _driver("--recipe", recipe, "--work", work, "--until", "shards", "--collect-args=--no-ray")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(work, "done"))) == ["shards.json"]
    cmd = ["--recipe", recipe, "--work", work, "--train-args=--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.recipe", *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"})
    latest, t0 = os.path.join(work, "run", "checkpoints", "latest.json"), time.time()
    while not os.path.isfile(latest) and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, out[-3000:] + err[-3000:]                          # stopped in the middle of training
    assert "stage shards: done before, skipped" in err
    assert "stopped by SIGTERM" in err and "run the same command again to continue" in err
    assert sorted(os.listdir(os.path.join(work, "done"))) == ["shards.json"]
    assert os.path.isfile(os.path.join(work, "configs", "weaver.yaml"))              # the resolved config, kept
    r = _driver(*cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(work, "run", "summary.json")) as f:
        assert json.load(f)["resumed_from"] > 0                                     # from the stop's checkpoint
    assert sorted(os.listdir(os.path.join(work, "done"))) == ["artifact.json", "shards.json", "weaver.json"]
    assert os.path.isfile(os.path.join(work, "artifact", "model.safetensors"))


def test_the_deadline_stops_a_running_stage_and_marks_nothing_done(tmp_path):
    from pipelines.recipe.__main__ import STOPPED, StopRequest, run_stage
    t0 = time.time()
    rc = run_stage([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
                   StopRequest(1.0), str(tmp_path / "log"))
    assert rc == STOPPED and time.time() - t0 < 60
    assert "started" in (tmp_path / "log").read_text()
    ok = tmp_path / "ok.yaml"
    ok.write_text("stages: [{name: a, kind: prompts, args: {out: x}}]")
    r = _driver("--recipe", str(ok), "--work", str(tmp_path / "w"), "--deadline", "0.001")
    assert r.returncode == 3 and "stopped by the deadline" in r.stderr, r.stderr[-2000:]
    assert os.listdir(tmp_path / "w" / "done") == []


def test_bad_recipes_are_refused_before_any_stage_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, message in [("stages: [{name: a, kind: bake}]", "kind must be one of"),
                          ("stages: [{name: a, kind: train}]", "needs a config file"),
                          ("stages: [{name: a, kind: train, config: nope.yaml}]", "does not exist"),
                          ("stages: [{name: a, kind: export, args: {run: x}}]", "needs args with run and out"),
                          ("stages: [{name: a, kind: prompts, args: {out: x}}, {name: a, kind: prompts, "
                           "args: {out: y}}]", "must be unique"),
                          ("stagez: []", "unknown keys"),
                          ("stages: [{name: a, kind: prompts}\n", "not valid YAML")]:
        bad.write_text(text)
        r = _driver("--recipe", str(bad), "--work", str(tmp_path / "w"))
        assert r.returncode == 2 and message in r.stderr, (text, r.stderr[-2000:])
    ok = tmp_path / "ok.yaml"
    ok.write_text("stages: [{name: a, kind: prompts, args: {out: x}}]")
    r = _driver("--recipe", str(ok), "--work", str(tmp_path / "w"), "--until", "b")
    assert r.returncode == 2 and "--until 'b'" in r.stderr


@pytest.mark.parametrize("recipe", ["recipe.yaml", "demo.yaml", "recipe_t1.yaml"])
def test_the_committed_smollm2_recipes_hold_valid_configs(tmp_path, recipe):
    """Every collect and train config of recipes/smollm2 parses once `{work}` is resolved, and the demo's export
    pushes to the repository pipelines.demo loads back."""
    import yaml

    from pipelines.collect.config import CollectConfig
    from pipelines.recipe.__main__ import Recipe, stage_command
    from pipelines.train.config import TrainConfig
    r = Recipe.load(os.path.join(ROOT, "recipes", "smollm2", recipe))
    work, cfgs = str(tmp_path), {}
    for stage in r.stages:
        cmd = stage_command(stage, r, work, {})
        if stage.kind in ("collect", "train"):
            with open(cmd[cmd.index("--config") + 1]) as f:
                d = yaml.safe_load(f)
            cfgs[stage.name] = cfg = (CollectConfig if stage.kind == "collect" else TrainConfig).from_dict(d)
            assert cfg.output_dir.startswith(work)
    if recipe == "recipe_t1.yaml":                # sampled continuations, in folders apart from the recipe's
        assert cfgs["anchors_t1"].temperature == 1.0 and cfgs["anchors_t1"].output_dir == f"{work}/anchors_t1"
        assert cfgs["weaver_t1"].data == [f"{work}/anchors_t1"] and cfgs["weaver_t1"].output_dir == f"{work}/weaver_t1"
    if recipe == "demo.yaml":
        from pipelines.demo import REPO_ID
        export = [s for s in r.stages if s.kind == "export"]
        assert export and export[-1].args.get("push") is True and export[-1].args.get("repo_id") == REPO_ID
