"""The whole cluster flow on one machine: `raytrain-lm cluster up` (cluster/local.yaml, fake GPU
nodes, token auth), `raytrain-lm submit` of a tiny run that asks for A100 nodes, the autoscaler
launching one, the workers landing on it, SUCCEEDED with the summary in the logs and every
line there once, the node leaving when idle; the demo config, which uses no GPU, getting a CPU
node and no GPU one; clients without the token are refused.

Fake GPUs cannot run CUDA: the run asks for the A100 type with `scaling.use_gpu=false`, so its
CPU workers carry the `accelerator_type:A100` marker and only fit on the fake A100 nodes.
Everything talks to the cluster from subprocesses: this pytest process holds its own Ray.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY

from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.faults import stop_pacing
from raytrain_lm.trainer.goodput import read_events
from raytrain_lm.trainer.stopping import STOP_ACKNOWLEDGED

pytestmark = [pytest.mark.cluster, pytest.mark.own_ray]

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    *TINY,
    "training.progress=true",
    "training.log_every=10",
    "training.max_steps=20",
    "training.eval_every=10",
    "checkpoint.every_steps=10",
    "tracking.enabled=false",
    "scaling.num_workers=2",
    "scaling.accelerator_type=A100",
    "scaling.capacity=spot",
    "scaling.use_gpu=false",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _cli(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(**env),
        timeout=timeout,
    )


def _state(dashboard: str, code: str) -> object:
    """Runs `code` (which sets `result`) against the cluster's state API in a subprocess."""
    script = (
        "import json\nfrom ray.util.state import list_actors, list_nodes\n"
        f"dashboard = {dashboard!r}\n{code}\nprint(json.dumps(result))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_env(RAY_AUTH_MODE="token"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PLACED_WORKERS = """
from ray.util.state import list_jobs
(job,) = [j.job_id for j in list_jobs(address=dashboard) if j.submission_id == {submission!r}]
nodes = {{n.node_id: n for n in list_nodes(address=dashboard, detail=True, limit=100)}}
workers = list_actors(
    address=dashboard, filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", job)]
)
result = [sorted(nodes[w.node_id].resources_total) for w in workers]
"""

ALIVE_WORKER_TYPES = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sorted(
    k for n in nodes if n.state == "ALIVE" for k in n.resources_total if k.startswith("accelerator_type:")
)
"""


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    """One storage dir for the module's jobs: the corpus is prepared once."""
    return tmp_path_factory.mktemp("storage")


def _submit(url: str, storage: Path, job: str, *args: str, timeout: float) -> str:
    """Submits and follows a job to its end; returns its logs."""
    done = _cli(
        "submit",
        *args,
        "--address",
        url,
        "--storage",
        str(storage),
        "--job-id",
        job,
        "--follow",
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"submitted job {job}" in done.stdout
    assert f"raytrain-lm logs {job} --follow" in done.stdout
    assert _cli("status", job, "--address", url).stdout.startswith(f"{job}: SUCCEEDED")
    return _cli("logs", job, "--address", url).stdout


@pytest.fixture(scope="module")
def local_cluster(request):
    # Short, private temp dir: Ray's socket paths must fit in 107 bytes, and `down` ends the
    # processes under this dir only, never other Rays on the machine.
    directory = tempfile.mkdtemp(prefix="rtlm-", dir="/tmp")
    failures_before = request.session.testsfailed
    up = _cli("cluster", "up", "--dir", directory, timeout=180)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        state = json.loads((Path(directory) / "cluster.json").read_text())
        yield state
    finally:
        down = _cli("cluster", "down", "--dir", directory, timeout=120)
        assert down.returncode == 0, down.stderr[-2000:]
        leftover = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
        assert directory not in leftover
        if request.session.testsfailed == failures_before:  # else keep the logs to look at
            shutil.rmtree(directory, ignore_errors=True)


def test_clients_without_the_token_are_refused(local_cluster):
    url = local_cluster["dashboard"]
    probe = (
        "from ray.job_submission import JobSubmissionClient\n"
        f"JobSubmissionClient({url!r}).list_jobs()"
    )
    no_mode = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert no_mode.returncode != 0
    assert "401" in no_mode.stderr or "nauthorized" in no_mode.stderr
    wrong = _cli("status", "nope", "--address", url, RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().count("\n") == 0 and "authentication refused" in wrong.stderr
    right = _cli("status", "nope", "--address", url)  # the token from ~/.ray/auth_token
    assert right.returncode == 2 and "authentication" not in right.stderr


def test_run_asking_for_a100_scales_up_lands_there_and_scales_down(local_cluster, storage):
    url = local_cluster["dashboard"]
    assert _state(url, ALIVE_WORKER_TYPES) == []  # only the head: no fake GPU node yet
    job = "a100-run"
    sets = [arg for item in [*RUN, "name=a100-run"] for arg in ("--set", item)]
    logs = _submit(url, storage, job, *sets, timeout=900)
    summary = json.loads(
        next(line for line in logs.splitlines() if line.startswith("summary: "))[9:]
    )
    assert summary["run"] == "a100-run" and summary["steps"] == 20
    assert Path(summary["checkpoint"]).is_relative_to(storage)  # relative output moved to storage
    # Every line once: every fake node's log monitor used to publish every node's lines.
    assert sum(" 20/20 | loss " in line for line in logs.splitlines()) == 1, logs[-3000:]
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type a100_spot" in line]
    assert len(added) == 1, added

    placed = _state(url, PLACED_WORKERS.format(submission=job))
    assert len(placed) == 2
    for resources in placed:
        assert "accelerator_type:A100" in resources and "spot" in resources

    # Same name again: the job resumes the finished run instead of training anew.
    again = _submit(url, storage, f"{job}-2", *sets, timeout=600)
    assert "already trained to step 20" in again

    # idle_timeout_minutes is 0.25 in cluster/local.yaml; allow for the autoscaler's lag
    deadline = time.time() + 170  # a kept request would hold the node for 180 s
    while _state(url, ALIVE_WORKER_TYPES) and time.time() < deadline:
        time.sleep(5)
    assert _state(url, ALIVE_WORKER_TYPES) == [], "the A100 node did not scale down when idle"


# Says what our driver says when asked to stop, then does not stop. The words come from the
# environment, and its "ready!" is built at run time: the job's log, which `raytrain-lm stop`
# reads, also echoes the command line.
STUCK_DRIVER = (
    'python -c "import os, ray, signal, time; ray.init(); '
    "signal.signal(signal.SIGTERM, lambda *_: print(os.environ['ACK'], flush=True)); "
    "print('ready' + '!', flush=True); time.sleep(600)\""
)


def _submit_raw(url: str, job: str, entrypoint: str) -> None:
    """Submits `entrypoint` as a job, with the stop grace period `raytrain-lm submit` sets."""
    env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": "150", "ACK": f"[raytrain-lm] {STOP_ACKNOWLEDGED}"}
    script = (
        "from ray.job_submission import JobSubmissionClient\n"
        f"JobSubmissionClient({url!r}).submit_job(entrypoint={entrypoint!r}, "
        f"submission_id={job!r}, runtime_env={{'env_vars': {env_vars!r}}})"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_env(RAY_AUTH_MODE="token"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


ALIVE_CPU_NODES = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sum(1 for n in nodes if n.state == "ALIVE" and "cpu_node" in n.resources_total)
"""


def _wait_for_log(url: str, job: str, text: str, timeout: float) -> None:
    """Follows the job's log (one process, not a poll: each CLI call costs a loaded 2-core
    machine seconds of CPU) until `text` appears; fails at once if the job ends first."""
    follow = subprocess.Popen(
        [sys.executable, "-m", "raytrain_lm.cli", "logs", job, "--address", url, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in follow.stdout:
            lines.append(line)
            if text in line:
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    follow.kill()
    follow.wait()
    tail = "".join(lines)[-3000:]
    assert found.is_set(), f"{text!r} not in the logs of {job} after {timeout} s:\n{tail}"


def _wait_for_status(url: str, job: str, status: str, timeout: float) -> float:
    started = time.time()
    while not _cli("status", job, "--address", url).stdout.startswith(f"{job}: {status}"):
        assert time.time() - started < timeout, _cli("logs", job, "--address", url).stdout[-3000:]
        time.sleep(1)
    return time.time() - started


def test_demo_config_gets_cpu_nodes_and_a_stop_checkpoints_then_frees_them(local_cluster, storage):
    """experiments/demo.yaml names no GPU type and finds no GPU: its workers ask for `cpu_node`
    (the head said the cluster has such nodes), so the autoscaler launches a CPU node type,
    where a worker group also starts cleanly (every fake node has its own copy of the job's
    files: MKL died in workers whose working dir another node had just unpacked again).

    `raytrain-lm stop` mid-run: the run checkpoints at its next step and ends (STOPPED), and the
    node leaves on the normal idle timeout, not when Ray Train's resource request expires
    (3 minutes). A job whose driver does not stop when asked ends at once on a second stop."""
    url = local_cluster["dashboard"]
    sets = [
        "experiments/demo.yaml",
        *[
            arg
            for item in [
                *TINY,
                "training.progress=true",
                "training.log_every=5",
                "training.max_steps=100000",  # stopped long before
                "checkpoint.every_steps=100000",
                "fault.preemption_check_s=0.5",
                "tracking.enabled=false",
                "name=demo-cpu",
            ]
            for arg in ("--set", item)
        ],
    ]
    args = ["--address", url, "--storage", str(storage)]
    assert _cli("submit", *sets, *args, "--job-id", "demo-cpu").returncode == 0
    _wait_for_log(url, "demo-cpu", "/100000 | loss", 600)
    stop = _cli("stop", "demo-cpu", "--address", url)
    assert stop.returncode == 0 and "demo-cpu: stopping: the run checkpoints" in stop.stdout
    _wait_for_status(url, "demo-cpu", "STOPPED", 300)
    logs = _cli("logs", "demo-cpu", "--address", url).stdout
    checkpointed = [line for line in logs.splitlines() if "stop: just-in-time checkpoint" in line]
    assert len(checkpointed) == 1, logs[-3000:]
    step = re.search(r"at step (\d+)", checkpointed[0]).group(1)
    assert f"run 'demo-cpu' stopped at step {step} with a checkpoint" in logs
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type" in line]
    assert added and all("of type cpu_" in line for line in added), added
    assert "oneMKL" not in logs
    placed = _state(url, PLACED_WORKERS.format(submission="demo-cpu"))
    assert len(placed) >= 2 and all("cpu_node" in resources for resources in placed), placed

    # idle_timeout_minutes is 0.25 in cluster/local.yaml: the nodes leave well before Ray
    # Train's resource request would have expired (180 s), as the stopped run withdrew it.
    stopped_at = time.time()
    while _state(url, ALIVE_CPU_NODES) and time.time() - stopped_at < 170:
        time.sleep(5)
    assert _state(url, ALIVE_CPU_NODES) == 0, "the CPU nodes stayed after the stop"

    # A driver whose graceful stop does not come (it only says it is stopping): a second
    # `stop` ends it at once, well before the supervisor's grace period (150 s here).
    _submit_raw(url, "stuck", STUCK_DRIVER)
    _wait_for_log(url, "stuck", "ready!", 300)  # not in the echoed command line
    assert "stopping:" in _cli("stop", "stuck", "--address", url).stdout
    _wait_for_log(url, "stuck", STOP_ACKNOWLEDGED, 180)
    second = _cli("stop", "stuck", "--address", url)
    assert "stuck: ended at once" in second.stdout, second.stdout + second.stderr
    assert _wait_for_status(url, "stuck", "STOPPED", 140) < 100


ALIVE_ON_DEMAND = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sum(1 for n in nodes if n.state == "ALIVE" and "on_demand" in n.resources_total)
"""
STEPS, BATCH = 300, 12


def _events_when(run_dir, done, timeout: float) -> list[dict]:
    started = time.time()
    while True:
        events = read_events(run_dir)
        if done(events):
            return events
        assert time.time() - started < timeout, [e["event"] for e in events][-20:]
        time.sleep(2)


def test_a_late_run_gets_an_on_demand_node_and_gives_it_back(local_cluster, storage):
    """scaling.capacity=spot_first with budget.deadline=8m: 300 steps, at most 3 workers of
    1.5 CPUs, so the two spot CPU nodes hold 2 and only the on-demand type a third. Paced at
    2 s a step (`slow-steps`, as a group short of capacity would crawl), the run is behind the
    uniform-progress line from its first step: it asks for an on-demand node, keeps training
    on spot until the node is up, then restarts on 3 workers. Faster from there (the pacing is
    switched off once the on-demand group runs: more workers would go faster on real nodes,
    not on these 2 shared cores), it gets ahead past the margin and goes back to spot only;
    the autoscaler removes the idle on-demand node. Every sequence trained once."""
    url = local_cluster["dashboard"]
    name = "late-run"
    sets = [
        *TINY,
        "training.progress=true",
        "training.log_every=10",
        f"training.max_steps={STEPS}",
        f"training.global_batch_size={BATCH}",
        f"training.eval_every={STEPS}",
        "training.ledger=true",
        "checkpoint.every_steps=100",
        "tracking.enabled=false",
        "scaling.use_gpu=false",
        "scaling.capacity=spot_first",
        "budget.deadline=8m",
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        "scaling.cpus_per_worker=1.5",
        "fault.price_per_hour={cpu:spot: 1, cpu:on_demand: 3}",
        f"name={name}",
    ]
    args = [arg for item in sets for arg in ("--set", item)]
    submitted = _cli(
        "submit", *args, "--address", url, "--storage", str(storage), "--job-id", name,
        RAYTRAIN_LM_FAULT="slow-steps:seconds=2",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    run_dir = RunDir.of(str(storage / "runs"), name)

    def on_demand_group_started(events: list[dict]) -> bool:
        switched = [i for i, e in enumerate(events) if e["event"] == "capacity"]
        return bool(switched) and any(e["event"] == "first_step" for e in events[switched[0] :])

    _events_when(run_dir, on_demand_group_started, 420)
    stop_pacing(run_dir)
    _wait_for_status(url, name, "SUCCEEDED", 420)
    events = read_events(run_dir)
    kinds = [e["event"] for e in events]
    (asked,) = [e for e in events if e["event"] == "capacity_request"]
    assert asked["workers"] == 1 and asked["slack_s"] < 0 and asked["world_size"] == 2
    decided = [e for e in events if e["event"] == "capacity_switch"]
    assert [d["market"] for d in decided] == ["on_demand", "spot"], kinds
    assert decided[0]["slack_s"] < 0 and decided[1]["slack_s"] > decided[1]["margin_s"]
    assert decided[1]["margin_s"] == pytest.approx(max(4.8, 2 * decided[1]["restart_s"]), abs=0.2)
    switches = [e for e in events if e["event"] == "capacity"]  # the driver's, after each end
    assert [(s["market"], s["step"]) for s in switches] == [
        (d["market"], d["step"]) for d in decided
    ]
    groups = [e for e in events if e["event"] == "segment_start"]
    assert [g["world_size"] for g in groups] == [2, 3, 2], kinds
    assert [g["price_per_hour"] for g in groups] == [2.0, 5.0, 2.0]  # the on-demand one at $3
    stops = [e.get("why") for e in events if e["event"] == "stop"]
    assert stops == ["capacity", "capacity"]
    assert read_ledger(run_dir).tolist() == list(range(STEPS * BATCH))

    logs = _cli("logs", name, "--address", url).stdout
    assert "asking for on-demand nodes for 1 more worker(s)" in logs
    assert "restarting on on-demand capacity" in logs and "restarting on spot capacity" in logs
    assert "back to spot nodes only; the on-demand nodes are given back" in logs
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type cpu_on_demand" in line]
    assert len(added) == 1, logs[-3000:]
    placed = _state(url, PLACED_WORKERS.format(submission=name))
    assert sum("on_demand" in resources for resources in placed) == 1, placed

    # Nothing of the run fits on it since the switch back: it leaves on the idle timeout.
    gone_by = time.time() + 120
    while _state(url, ALIVE_ON_DEMAND) and time.time() < gone_by:
        time.sleep(5)
    assert _state(url, ALIVE_ON_DEMAND) == 0, "the on-demand node stayed after the switch back"
