"""The collect job end to end on a real Ray cluster: `ray start --head` + `ray job submit`, then resume after a kill.

The cluster is private to this module: loopback addresses, free ports, its own temp dir (so that no other
`ray.init()` on the machine finds and joins it), token auth off for every process (RAY_AUTH_MODE: Ray turns
token auth on for a local ray.init() and then refuses job submissions that carry none). It is started with `ray start --block` in a new session and torn down
by signalling that process group: `ray stop` would stop every Ray process on the machine, not only ours.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
N_PROMPTS = 32
JOB_TIMEOUT_S = 300
# The job config. Shards of 2 samples make 16 shards, so a kill after the first one lands mid-run.
CONFIG = {"target": "tiny:llama:0", "drafter": "tiny:llama:0", "max_new_tokens": 24, "anchors_per_sequence": 4,
          "candidate_pool": 16, "target_topk": 8, "samples_per_shard": 2, "max_prompt_tokens": 60}
BF16 = dict(rtol=2 ** -8, atol=1e-4)         # bf16 rounding: <= half an ulp <= 2^-8 relative; plus fp32 noise


def _free_ports(n: int) -> list[int]:
    """n distinct ports that are free now, drawn from outside the kernel's ephemeral range and Ray's worker ports
    (10002-19999): a port handed out by `bind(0)` is ephemeral, so any process of the cluster that later binds
    port 0 (a gRPC server, a metrics exporter) could take it before the component we meant it for. Seen in CI:
    the dashboard agent failed to bind its HTTP port and the job was never run."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    pool = [p for p in range(20000, 65536) if not lo <= p <= hi]
    assert len(pool) >= 1000, f"ephemeral range {lo}-{hi} leaves too few fixed ports"
    ports: list[int] = []
    for p in random.sample(pool, len(pool)):
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", p))
        except OSError:
            continue
        ports.append(p)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"found only {len(ports)} of {n} free ports")


def _http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class ClusterStartError(RuntimeError):
    """The throwaway cluster did not come up; a fresh one (new ports, new temp dir) may."""


class Cluster:
    def __init__(self, root: str):
        self.root = root
        (self.port, self.dash, self.agent, client, node_manager, object_manager, runtime_env, agent_grpc,
         metrics) = _free_ports(9)
        self.url = f"http://127.0.0.1:{self.dash}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=root, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PATH=VENV_BIN + os.pathsep + env.get("PATH", ""))
        env.pop("RAY_API_SERVER_ADDRESS", None)
        self.env = env
        self.ray = os.path.join(VENV_BIN, "ray")
        self.log = open(os.path.join(root, "ray_start.log"), "w")
        cmd = [self.ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
               "--num-cpus", "2", "--disable-usage-stats", "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dash),
               "--dashboard-agent-listen-port", str(self.agent), "--ray-client-server-port", str(client),
               "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
               "--runtime-env-agent-port", str(runtime_env), "--dashboard-agent-grpc-port", str(agent_grpc),
               "--metrics-export-port", str(metrics),
               "--temp-dir", os.path.join(root, "ray")]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the job API answers and the head node's dashboard agent (which runs submitted jobs) answers its
        health check: on a busy 2-core machine the agent can come up seconds after the API. An agent that could not
        bind its HTTP port stays alive without it, so its log is checked too (raises ClusterStartError)."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise ClusterStartError(f"ray start exited with {self.proc.returncode}:\n{self.read_log()}")
            if "Failed to start HTTP server" in self.dashboard_logs(tail=None):
                raise ClusterStartError(f"the dashboard agent has no HTTP server:\n{self.dashboard_logs()}")
            try:
                _http_json(f"{self.url}/api/jobs/", timeout=2)
                with urllib.request.urlopen(f"http://127.0.0.1:{self.agent}/api/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise ClusterStartError(f"the Ray job API at {self.url} or the agent on port {self.agent} did not come up "
                                f"in {timeout} s:\n{self.read_log()}\n{self.dashboard_logs()}")

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        """SIGKILL the process group of `ray start --block` (everything this cluster started, workers and job drivers
        included). A throwaway cluster needs no drain: SIGTERM makes it drain for 30 s."""
        pgid = self.proc.pid                                   # start_new_session: the group id is its pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        t_end = time.monotonic() + 15
        while _group_alive(pgid) and time.monotonic() < t_end:
            time.sleep(0.2)
        self.log.close()

    # ---- jobs -----------------------------------------------------------------------------------
    def submit(self, config_path: str, attempts: int = 4) -> str:
        """`ray job submit --working-dir <repo> -- python -m pipelines.collect --config ...` -> submission id.

        A dropped HTTP connection (seen once in CI: RemoteDisconnected while the dashboard was busy) is retried
        with the same submission id, after checking whether the server took the job anyway."""
        sid = "collect-" + uuid.uuid4().hex[:8]
        excludes = [".venv", ".git", ".pytest_cache", "**/__pycache__", "*.egg-info", "runs", "out"]
        cmd = [self.ray, "job", "submit", "--address", self.url, "--submission-id", sid, "--no-wait",
               "--working-dir", REPO, "--runtime-env-json", json.dumps({"excludes": excludes}),
               "--", "python", "-m", "pipelines.collect", "--config", config_path, "--no-progress"]
        failures = []
        for attempt in range(attempts):
            r = subprocess.run(cmd, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                return sid
            failures.append(f"attempt {attempt + 1}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            if "ConnectionError" not in r.stderr and "Connection" not in r.stderr:
                break                                              # a real refusal: retrying will not help
            time.sleep(2.0 * (attempt + 1))
            try:
                self.info(sid)                                     # the server has it after all
                return sid
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
        pytest.fail("ray job submit failed:\n" + "\n".join(failures) + "\n" + self.dashboard_logs())

    def dashboard_logs(self, tail: int | None = 3000) -> str:
        out = []
        for name in ("dashboard.log", "dashboard_agent.log"):
            for p in glob.glob(os.path.join(self.root, "ray", "session_latest", "logs", name)):
                with open(p, errors="replace") as f:
                    out.append(f"--- {name} (tail) ---\n{f.read()[-tail if tail else 0:]}")
        return "\n".join(out)

    def info(self, sid: str) -> dict:
        return _http_json(f"{self.url}/api/jobs/{sid}")

    def logs(self, sid: str) -> str:
        return _http_json(f"{self.url}/api/jobs/{sid}/logs")["logs"]

    def wait(self, sid: str, timeout: float = JOB_TIMEOUT_S) -> dict:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            info = self.info(sid)
            if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {sid} not finished after {timeout} s; logs:\n{self.logs(sid)[-5000:]}")


def _group_alive(pgid: int) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            return True
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return False


@pytest.fixture(scope="module")
def cluster(request):
    """A ready cluster; one that fails to come up is torn down and started afresh, at most three times."""
    errors = []
    for _ in range(3):
        root = tempfile.mkdtemp(prefix="tfmray-", dir="/tmp")  # short: Ray's unix socket paths live under it
        c = Cluster(root)
        try:
            c.wait_ready()
        except ClusterStartError as e:
            errors.append(str(e)[-4000:])
            c.stop()
            shutil.rmtree(root, ignore_errors=True)
            continue
        request.addfinalizer(lambda: (c.stop(), shutil.rmtree(root, ignore_errors=True)))
        return c
    pytest.fail("the Ray cluster did not come up in 3 tries:\n" + "\n---\n".join(errors))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("collect_job")
    topics = ["rivers", "prime numbers", "bread", "volcanoes", "chess", "tides", "owls", "glass"]
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(N_PROMPTS):                           # 43..53 tokens with the chat template: all usable
            f.write(json.dumps({"prompt": f"Tell me about {topics[i % len(topics)]} (#{i})."}) + "\n")
    return d


def _write_config(workdir, name: str) -> tuple[str, str]:
    out = str(workdir / name)
    path = str(workdir / f"{name}.json")
    with open(path, "w") as f:
        json.dump({**CONFIG, "inputs": [str(workdir / "prompts.jsonl")], "output_dir": out}, f)
    return path, out


@pytest.fixture(scope="module")
def reference_run(cluster, workdir):
    """One uninterrupted job: (config path, output dir, job logs)."""
    cfg, out = _write_config(workdir, "reference")
    sid = cluster.submit(cfg)
    info = cluster.wait(sid)
    logs = cluster.logs(sid)
    assert info["status"] == "SUCCEEDED", f"{info.get('message')}\n{logs[-5000:]}"
    return cfg, out, logs


def _manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _check_folder(out: str) -> dict:
    """The manifest lists exactly the shard files, with their sizes, row counts and hashes; no temp files."""
    m = _manifest(out)
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.parquet")))
    assert files == sorted(m["shards"]), "shard files and manifest disagree"
    leftovers = [p for p in os.listdir(out) if p.endswith(".tmp") or p.startswith(".")]
    assert not leftovers, f"temp files left behind: {leftovers}"
    assert set(os.listdir(out)) == set(files) | {"manifest.json", "collect_config.json"}
    for name, facts in m["shards"].items():
        p = os.path.join(out, name)
        assert os.path.getsize(p) == facts["bytes"] and _sha256(p) == facts["sha256"], name
        assert pq.ParquetFile(p).metadata.num_rows == facts["rows"], name
    return m


# ---- 1. ray job submit on 32 prompts: files, loaders, schema, values --------------------------------------------
def test_job_submit_writes_shards_that_match_the_contract_and_a_recomputation(reference_run):
    from pipelines.collect.config import CollectConfig
    from pipelines.collect.models import check_pair
    from pipelines.shards import anchor_columns, column

    cfg_path, out, logs = reference_run
    assert "Progress bars disabled" not in logs and "execution finished" not in logs
    m = _check_folder(out)
    cfg = CollectConfig.load(cfg_path)
    n_shards = -(-N_PROMPTS // cfg.samples_per_shard)
    assert len(m["shards"]) == n_shards and m["skipped"] == {}
    spans = sorted(s["samples"] for s in m["shards"].values())
    step = cfg.samples_per_shard
    assert spans == [[i, min(i + step, N_PROMPTS) - 1] for i in range(0, N_PROMPTS, step)]
    paths = [os.path.join(out, n) for n in sorted(m["shards"])]
    total = sum(s["rows"] for s in m["shards"].values())
    assert total > 0

    # The contract's shapes and dtypes, column by column.
    c = m["contract"]
    assert c == check_pair(cfg).to_dict()
    L, H, K, k = c["lookahead"], c["target_hidden_size"], c["candidate_pool"], min(m["config"]["target_topk"],
                                                                                   c["vocab_size"])
    assert (K, k) == (cfg.candidate_pool, cfg.target_topk)
    cols = anchor_columns(L, H, K, k)
    storage = {"int64": pa.int64(), "int32": pa.int32(), "bool": pa.bool_(), "bf16": pa.uint16()}
    tables = [pq.read_table(p) for p in paths]
    for t in tables:
        assert t.schema.names == list(cols)
        meta = t.schema.metadata
        assert json.loads(meta[b"tfm.shapes"]) == {n: [dt, list(s)] for n, (dt, s) in cols.items()}
        assert int(meta[b"tfm.schema_version"]) == m["schema_version"]
        assert json.loads(meta[b"tfm.contract"]) == c
        for name, (dt, shape) in cols.items():
            typ = t.schema.field(name).type
            if shape:
                assert typ == pa.list_(storage[dt], int(np.prod(shape))), (name, typ)
            else:
                assert typ == storage[dt], (name, typ)
    table = pa.concat_tables(tables)
    assert table.num_rows == total

    # Both readers the train side may use.
    import datasets
    ds = datasets.load_dataset("parquet", data_files=paths, split="train",
                               cache_dir=os.path.join(os.path.dirname(out), "hf_cache"))
    assert ds.num_rows == total and ds.column_names == list(cols)
    assert np.array_equal(np.asarray(ds["sample_id"]), table.column("sample_id").to_numpy())
    assert np.array_equal(np.asarray(ds["cand_ids"][:3], dtype=np.int32).reshape(-1),
                          column(table.slice(0, 3), "cand_ids").reshape(-1))

    # Recompute sampled sequences in-process with the runtime's incremental path.
    sids = column(table, "sample_id")
    picks = sorted({int(sids[0]), int(sids[len(sids) // 2]), int(sids[-1])})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny matmuls: more OpenMP threads only spin against the Ray processes
    try:
        _recompute_and_compare(cfg, table, picks)
    finally:
        torch.set_num_threads(threads)


def _greedy(target, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Greedy continuation by full forwards of the TargetModel (independent of `generate` and its padding)."""
    seq = list(prompt)
    for _ in range(max_new):
        nxt = int(target(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
    return seq[len(prompt):]


def _check_topk(ids: np.ndarray, vals: np.ndarray, full: torch.Tensor, what: str) -> None:
    """Stored top-k (ids, values) against full recomputed scores [n, V]: same values, each stored id carrying its own
    score, and the same ids except where neighbouring scores tie within the bf16 tolerance."""
    ids, vals = torch.from_numpy(np.array(ids, dtype=np.int64)), torch.from_numpy(np.array(vals))
    kk = ids.shape[-1]
    ref_vals, ref_ids = full.topk(min(kk + 1, full.shape[-1]), dim=-1)
    torch.testing.assert_close(vals, ref_vals[:, :kk], **BF16, msg=lambda s: f"{what} values: {s}")
    torch.testing.assert_close(vals, full.gather(-1, ids), **BF16, msg=lambda s: f"{what} id/value pairs: {s}")
    tol = BF16["atol"] + 2 * BF16["rtol"] * ref_vals.abs()
    gaps = (ref_vals[:, :-1] - ref_vals[:, 1:]).abs()                                  # [n, kk]
    near = torch.zeros_like(ids, dtype=torch.bool)
    near |= gaps[:, :kk] < tol[:, :kk]
    near[:, 1:] |= gaps[:, :kk - 1] < tol[:, 1:kk]
    bad = (ids != ref_ids[:, :kk]) & ~near
    assert not bad.any(), f"{what}: ids differ away from ties at {bad.nonzero().tolist()[:5]}"


@torch.no_grad()
def _recompute_and_compare(cfg, table: pa.Table, sample_ids: list[int]) -> None:
    from pipelines.collect.inputs import list_input_files, read_records, tokenize
    from pipelines.collect.models import load_models
    from tfm_runtime.loading import load_tokenizer
    from pipelines.shards import column

    tok = load_tokenizer(cfg.target)
    samples, _ = tokenize(read_records(list_input_files(cfg.inputs)), tok, prompt_field=cfg.prompt_field,
                          response=cfg.response, max_prompt_tokens=cfg.max_prompt_tokens)
    by_id = {s.sample_id: s for s in samples}
    target, drafter = load_models(cfg, torch.device("cpu"))
    assert target.dtype == torch.float32                                              # what the job used on CPU
    L = drafter.lookahead
    col = {n: column(table, n) for n in table.schema.names}
    checked = 0
    for sid in sample_ids:
        rows = np.nonzero(col["sample_id"] == sid)[0]
        prompt = by_id[sid].prompt_ids
        seq = prompt + _greedy(target, prompt, cfg.max_new_tokens, tok.eos_token_id)
        T, P = len(seq), len(prompt)
        x = torch.tensor(seq)
        out = target(x[None])
        logp = torch.log_softmax(out.logits[0].float(), -1)
        cache = drafter.new_cache()
        order = rows[np.argsort(col["anchor_pos"][rows])]
        assert len(order) == min(cfg.anchors_per_sequence, max(0, T - 2 - max(1, P) + 1))
        for r in order:
            a = int(col["anchor_pos"][r])
            assert P <= a <= T - 2
            # tokens: the row sits on this sequence
            assert col["root_token"][r] == seq[a]
            want_true = [seq[a + 1 + d] if a + 1 + d < T else -1 for d in range(L)]
            assert col["true_tokens"][r].tolist() == want_true
            assert col["loss_mask"][r].tolist() == [t >= 0 for t in want_true]
            inside = np.array(want_true) >= 0
            # target: h_final at a-1, top-k of the log-softmax at a..a+L-1 (teacher forcing)
            torch.testing.assert_close(torch.from_numpy(col["h_final"][r]), out.h_final[0, a - 1], **BF16)
            pos = [a + d for d in range(L) if inside[d]]
            _check_topk(col["target_topk_ids"][r][inside], col["target_topk_logprobs"][r][inside], logp[pos],
                        f"sample {sid} anchor {a} target top-k")
            assert (col["target_topk_ids"][r][~inside] == -1).all()
            assert (col["target_topk_logprobs"][r][~inside] == 0).all()
            # greedy rollout: each response token is the target's argmax
            assert [int(i) for i in col["target_topk_ids"][r][inside][:, 0]] == [want_true[d] for d in range(L)
                                                                                 if inside[d]]
            # DFlash: context = taps at positions < a (incremental cache), block [x_a, MASK...]
            drafter.extend_context(cache, out.taps[:, cache.length:a])
            assert cache.length == a
            logits, hidden = drafter.draft(cache, x[a:a + 1], target.embed_weight, target.lm_head_weight)
            torch.testing.assert_close(torch.from_numpy(col["dflash_hidden"][r]), hidden[0].float(), **BF16)
            _check_topk(col["cand_ids"][r], col["cand_logits"][r], logits[0].float(),
                        f"sample {sid} anchor {a} DFlash candidates")
            checked += 1
    assert checked >= 3


def _driver_python(pid: int) -> str | None:
    """The interpreter the job's `python` entrypoint resolved to, from the driver's own PATH."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return shutil.which("python", path=env.get(b"PATH", b"").decode())


# ---- 2. SIGKILL the job's driver mid-run, re-submit: exactly the rows of the uninterrupted run -------------------
def test_resubmit_after_driver_sigkill_resumes_to_the_uninterrupted_result(cluster, workdir, reference_run):
    _, ref_out, _ = reference_run
    cfg, out = _write_config(workdir, "resumed")
    n_shards = -(-N_PROMPTS // CONFIG["samples_per_shard"])
    sid = cluster.submit(cfg)
    t_end, pid, driver_python = time.monotonic() + JOB_TIMEOUT_S, None, None
    done_at_kill: dict = {}
    while time.monotonic() < t_end:
        info = cluster.info(sid)
        assert info["status"] in ("PENDING", "RUNNING"), f"job ended before the kill:\n{cluster.logs(sid)[-3000:]}"
        pid = pid or (info.get("driver_info") or {}).get("pid")
        try:
            done_at_kill = _manifest(out)["shards"]
        except (FileNotFoundError, ValueError):
            pass
        if pid and not driver_python:
            driver_python = _driver_python(int(pid))
        if pid and done_at_kill:
            os.kill(int(pid), signal.SIGKILL)
            break
        time.sleep(0.05)
    else:
        pytest.fail("no shard reached the manifest in time")
    assert 1 <= len(done_at_kill) < n_shards, "the kill did not land mid-run"
    assert driver_python == os.path.join(VENV_BIN, "python"), driver_python        # the job's `python` is ours
    info = cluster.wait(sid, timeout=60)
    assert info["status"] == "FAILED", info
    # What the kill left: complete shards under final names only (atomic writes); maybe temp files.
    for p in glob.glob(os.path.join(out, "*.parquet")):
        pq.read_table(p)
    listed = sorted(_manifest(out)["shards"])
    assert 1 <= len(listed) < n_shards
    # Make it harder: a listed shard damaged after the fact (must be redone) and a stale temp file (must go).
    victim = listed[0]
    with open(os.path.join(out, victim), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(out, victim)) // 2)
    unlisted = sorted(set(_manifest(ref_out)["shards"]) - set(listed))[0]
    with open(os.path.join(out, f".{unlisted}.deadbeef.tmp"), "wb") as f:
        f.write(b"PAR1 half a shard")
    kept = {n: os.stat(os.path.join(out, n)).st_ino for n in listed[1:]}

    sid2 = cluster.submit(cfg)
    info = cluster.wait(sid2)
    logs = cluster.logs(sid2)
    assert info["status"] == "SUCCEEDED", f"{info.get('message')}\n{logs[-5000:]}"
    done = int(logs.split(" already done")[0].rsplit(", ", 1)[1])
    assert done == len(listed) - 1, logs[-3000:]
    # Intact shards finished before the kill were skipped, not rewritten; the damaged one was.
    assert {n: os.stat(os.path.join(out, n)).st_ino for n in kept} == kept

    m, ref = _check_folder(out), _manifest(ref_out)
    assert m["config_hash"] == ref["config_hash"]
    assert sorted(m["shards"]) == sorted(ref["shards"])
    for name, facts in ref["shards"].items():
        got = m["shards"][name]
        assert (got["samples"], got["rows"]) == (facts["samples"], facts["rows"]), name
        a, b = pq.read_table(os.path.join(out, name)), pq.read_table(os.path.join(ref_out, name))
        assert a.equals(b, check_metadata=True), f"{name}: rows differ from the uninterrupted run"
        assert got["sha256"] == facts["sha256"], f"{name}: same rows, different bytes"
    rows = pa.concat_tables([pq.read_table(os.path.join(out, n)) for n in sorted(m["shards"])])
    keys = list(zip(rows["sample_id"].to_pylist(), rows["anchor_pos"].to_pylist()))
    assert len(keys) == len(set(keys)) == sum(s["rows"] for s in ref["shards"].values()), "duplicate or lost rows"
