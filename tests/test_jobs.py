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

import getpass
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import requests
from conftest import TINY
from support.jobs import (
    ALIVE_CPU_NODES,
    ALIVE_ON_DEMAND,
    ALIVE_WORKER_TYPES,
    PLACED_WORKERS,
    RAY_DATA_ACTORS_ON_HEAD,
    TEST_CLUSTER_ENV,
    cli,
    env,
    events_when,
    mfu_per_token_ratio,
    processes_of,
    state,
    submit,
    submit_raw,
    wait_for_log,
    wait_for_status,
)

from raytrain_lm import audit, checkpoint_models
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.results import mlflow_run
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir
from raytrain_lm.runtime import free_port
from raytrain_lm.tracking.server import read_env_file
from raytrain_lm.trainer.chaos import stop_pacing
from raytrain_lm.trainer.driver.stopping import STOP_ACKNOWLEDGED

pytestmark = [pytest.mark.cluster, pytest.mark.own_ray]
SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"

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


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    """One storage dir for the module's jobs: the corpus is prepared once."""
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def local_cluster(request):
    # Short, private temp dir: Ray's socket paths must fit in 107 bytes, and `down` ends the
    # processes under this dir only, never other Rays on the machine.
    directory = tempfile.mkdtemp(prefix="rtlm-", dir="/tmp")
    failures_before = request.session.testsfailed
    tag = {TEST_CLUSTER_ENV: uuid.uuid4().hex}  # inherited by every process of the cluster
    # As shipped, with the team's MLflow server beside the head: its records in a home of the
    # test's own, on a free port.
    home = tempfile.mkdtemp(prefix="rtlm-tracking-")
    server = ("--tracking-home", home, "--tracking-port", str(free_port()))
    up = cli("cluster", "up", "--dir", directory, *server, timeout=420, **tag)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        state = json.loads((Path(directory) / "cluster.json").read_text())
        assert f"tracking: {state['tracking']['url']} (logins on" in up.stdout
        yield state
    finally:
        down = cli("cluster", "down", "--dir", directory, timeout=180)
        assert down.returncode == 0, down.stderr[-2000:]
        assert processes_of(directory, tag) == [], "left running after `cluster down`"
        # The server stopped its database before anything was killed: a clean shutdown.
        assert not (Path(home) / "postgres" / "postmaster.pid").exists()
        if request.session.testsfailed == failures_before:  # else keep the logs to look at
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


def test_the_tracking_server_refuses_clients_without_its_login(local_cluster):
    url = local_cluster["tracking"]["url"]
    anonymous = requests.get(f"{url}{SEARCH}", timeout=60)
    assert anonymous.status_code == 401
    wrong = requests.get(f"{url}{SEARCH}", auth=("admin", "not-the-password"), timeout=60)
    assert wrong.status_code == 401
    right = requests.get(f"{url}{SEARCH}", auth=_admin(local_cluster), timeout=60)
    assert right.status_code == 200


def _admin(local_cluster) -> tuple[str, str]:
    login = read_env_file(Path(local_cluster["tracking"]["login"]))
    return login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"]


def test_clients_without_the_token_are_refused(local_cluster):
    url = local_cluster["dashboard"]
    probe = (
        "from ray.job_submission import JobSubmissionClient\n"
        f"JobSubmissionClient({url!r}).list_jobs()"
    )
    no_mode = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env(), timeout=60
    )
    assert no_mode.returncode != 0
    assert "401" in no_mode.stderr or "nauthorized" in no_mode.stderr
    wrong = cli("status", "nope", "--address", url, RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().count("\n") == 0 and "authentication refused" in wrong.stderr
    right = cli("status", "nope", "--address", url)  # the token from ~/.ray/auth_token
    assert right.returncode == 2 and "authentication" not in right.stderr


def test_run_asking_for_a100_scales_up_lands_there_and_scales_down(
    local_cluster, storage, monkeypatch
):
    url = local_cluster["dashboard"]
    assert state(url, ALIVE_WORKER_TYPES) == []  # only the head: no fake GPU node yet
    job = "a100-run"
    tracked = [item for item in RUN if item != "tracking.enabled=false"]  # its MLflow run, below
    sets = [arg for item in [*tracked, "name=a100-run"] for arg in ("--set", item)]
    logs = submit(url, storage, job, *sets, timeout=900)
    summary = json.loads(
        next(line for line in logs.splitlines() if line.startswith("summary: "))[9:]
    )
    assert summary["run"] == "a100-run" and summary["steps"] == 20
    assert Path(summary["checkpoint"]).is_relative_to(storage)  # relative output moved to storage
    # Every line once: every fake node's log monitor used to publish every node's lines.
    assert sum(" 20/20 | loss " in line for line in logs.splitlines()) == 1, logs[-3000:]
    # One MFU, against the device that trains (the CPU of a fake A100 node, not an A100).
    assert 0.6 < mfu_per_token_ratio(logs, "20/20", summary["per_type"]["A100"]) < 1.6
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type a100_spot" in line]
    assert len(added) == 1, added

    placed = state(url, PLACED_WORKERS.format(submission=job))
    assert len(placed) == 2
    for resources in placed:
        assert "accelerator_type:A100" in resources and "spot" in resources
    # Made by the driver, not by the first worker to read: on the head, never on a spot node.
    assert state(url, RAY_DATA_ACTORS_ON_HEAD) == [
        ["ActorLocationTracker", True],
        ["_StatsActor", True],
    ]

    # Same name again: the job resumes the finished run instead of training anew.
    again = submit(url, storage, f"{job}-2", *sets, timeout=600)
    assert "already trained to step 20" in again

    # Each submit left a record in the storage's audit log, as `raytrain-lm audit` lists it,
    # and tagged the MLflow run with the same facts.
    listed = cli("audit", "--storage", str(storage), "--run", job, "--since", "1h")
    lines = listed.stdout.splitlines()
    assert listed.returncode == 0 and len(lines) == 2, listed.stdout + listed.stderr
    assert all(f" submit run={job} job_id={job}" in line for line in lines), lines
    assert f"job_id={job}-2 cluster={url}" in lines[1]
    submitted = [r for r in audit.read(storage, run=job) if r["job_id"] == job][0]
    assert submitted["user"] == getpass.getuser() and len(submitted["git_commit"]) == 40
    assert "submit" in submitted["command"] and submitted["config_digest"]
    # The job logged to the cluster's server, as its admin, without a setting.
    server = local_cluster["tracking"]
    assert mlflow_run(job, storage / "runs") == (server["url"], summary["mlflow_run_id"])
    username, password = _admin(local_cluster)
    login = {"MLFLOW_TRACKING_USERNAME": username, "MLFLOW_TRACKING_PASSWORD": password}
    for key, value in login.items():
        monkeypatch.setenv(key, value)
    from mlflow.tracking import MlflowClient

    store = MlflowClient(server["url"])
    tags = store.get_run(summary["mlflow_run_id"]).data.tags
    ours = {key: value for key, value in tags.items() if key.startswith(audit.TAG_PREFIX)}
    assert ours == audit.mlflow_tags(submitted)  # the second job found the run finished
    # Its checkpoints are its models; the best is promoted and sampled through its alias, as a
    # user does with the admin's login from `cluster up`.
    assert sorted(checkpoint_models(job, storage / "runs").index) == [10, 20]
    promoted = cli("promote", job, "--best", "val_loss", "--name", "a100-lm",
                   "--output-dir", str(storage / "runs"), **login)  # fmt: skip
    assert promoted.returncode == 0, promoted.stderr[-2000:]
    assert "a100-lm version 1 is step " in promoted.stdout
    sampled = cli("generate", "--run", "models:/a100-lm@champion", "--prompt", "def ",
                  "--tokens", "4", MLFLOW_TRACKING_URI=server["url"], **login)  # fmt: skip
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr[-2000:]
    listed = cli("audit", "--storage", str(storage), "--run", job, "--since", "1h")
    assert f" promote run={job} " in listed.stdout.splitlines()[-1], listed.stdout

    # idle_timeout_minutes is 0.25 in cluster/local.yaml; allow for the autoscaler's lag
    deadline = time.time() + 170  # a kept request would hold the node for 180 s
    while state(url, ALIVE_WORKER_TYPES) and time.time() < deadline:
        time.sleep(5)
    assert state(url, ALIVE_WORKER_TYPES) == [], "the A100 node did not scale down when idle"


# Says what our driver says when asked to stop, then does not stop. The words come from the
# environment, and its "ready!" is built at run time: the job's log, which `raytrain-lm stop`
# reads, also echoes the command line.
STUCK_DRIVER = (
    'python -c "import os, ray, signal, time; ray.init(); '
    "signal.signal(signal.SIGTERM, lambda *_: print(os.environ['ACK'], flush=True)); "
    "print('ready' + '!', flush=True); time.sleep(600)\""
)


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
    assert cli("submit", *sets, *args, "--job-id", "demo-cpu").returncode == 0
    wait_for_log(url, "demo-cpu", "/100000 | loss", 600)
    stop = cli("stop", "demo-cpu", "--address", url)
    assert stop.returncode == 0 and "demo-cpu: stopping: the run checkpoints" in stop.stdout
    actions = [(r["action"], r["job_id"]) for r in audit.read(storage, run="demo-cpu")]
    assert actions == [("submit", "demo-cpu"), ("stop", "demo-cpu")]  # before it acted
    wait_for_status(url, "demo-cpu", "STOPPED", 300)
    logs = cli("logs", "demo-cpu", "--address", url).stdout
    checkpointed = [line for line in logs.splitlines() if "stop: just-in-time checkpoint" in line]
    assert len(checkpointed) == 1, logs[-3000:]
    step = re.search(r"at step (\d+)", checkpointed[0]).group(1)
    assert f"run 'demo-cpu' stopped at step {step} with a checkpoint" in logs
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type" in line]
    assert added and all("of type cpu_" in line for line in added), added
    assert "oneMKL" not in logs
    placed = state(url, PLACED_WORKERS.format(submission="demo-cpu"))
    assert len(placed) >= 2 and all("cpu_node" in resources for resources in placed), placed

    # idle_timeout_minutes is 0.25 in cluster/local.yaml: the nodes leave well before Ray
    # Train's resource request would have expired (180 s), as the stopped run withdrew it.
    stopped_at = time.time()
    while state(url, ALIVE_CPU_NODES) and time.time() - stopped_at < 170:
        time.sleep(5)
    assert state(url, ALIVE_CPU_NODES) == 0, "the CPU nodes stayed after the stop"

    # A driver whose graceful stop does not come (it only says it is stopping): a second
    # `stop` ends it at once, well before the supervisor's grace period (150 s here).
    submit_raw(url, "stuck", STUCK_DRIVER)
    wait_for_log(url, "stuck", "ready!", 300)  # not in the echoed command line
    assert "stopping:" in cli("stop", "stuck", "--address", url).stdout
    wait_for_log(url, "stuck", STOP_ACKNOWLEDGED, 180)
    second = cli("stop", "stuck", "--address", url)
    assert "stuck: ended at once" in second.stdout, second.stdout + second.stderr
    assert wait_for_status(url, "stuck", "STOPPED", 140) < 100


STEPS, BATCH = 300, 12
DEADLINE_S, PACED_STEP_S = 1200, 5


def test_a_late_run_gets_an_on_demand_node_and_gives_it_back(local_cluster, storage):
    """scaling.capacity=spot_first with budget.deadline=20m: 300 steps, at most 3 workers of
    1.5 CPUs, so the two spot CPU nodes hold 2 and only the on-demand type a third. Paced at
    5 s a step (`slow-steps`, as a group short of capacity would crawl) where the
    uniform-progress line allows 4, the run is behind that line from its first step: it asks
    for an on-demand node, keeps training on spot until the node is up, then restarts on 3
    workers. Faster from there (the pacing is switched off once the on-demand group runs: more
    workers would go faster on real nodes, not on these 2 shared cores), it gets ahead past the
    margin and goes back to spot only; the autoscaler removes the idle on-demand node. Every
    sequence trained once.

    The line's 4 s a step is what makes the switch back certain on a loaded machine: the margin
    is twice the measured restart (one CI run restarted so slowly that, at 8 minutes and 1.6 s a
    step, the unpaced steps never got past it before the last step). Here each unpaced step
    gains about 4 s; the test's own length does not depend on the deadline."""
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
        f"budget.deadline={DEADLINE_S // 60}m",
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        "scaling.cpus_per_worker=1.5",
        "fault.price_per_hour={cpu:spot: 1, cpu:on_demand: 3}",
        f"name={name}",
    ]
    args = [arg for item in sets for arg in ("--set", item)]
    submitted = cli(
        "submit", *args, "--address", url, "--storage", str(storage), "--job-id", name,
        RAYTRAIN_LM_FAULT=f"slow-steps:seconds={PACED_STEP_S}",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    run_dir = RunDir.of(str(storage / "runs"), name)

    def on_demand_group_started(events: list[dict]) -> bool:
        switched = [i for i, e in enumerate(events) if e["event"] == "capacity"]
        return bool(switched) and any(e["event"] == "first_step" for e in events[switched[0] :])

    events_when(run_dir, on_demand_group_started, 420)
    stop_pacing(run_dir)
    # Two restarts at most from here, each up to 4 minutes in CI (nodes removed and added again)
    wait_for_status(url, name, "SUCCEEDED", 600)
    events = read_events(run_dir)
    kinds = [e["event"] for e in events]
    asked, *asked_again = [e for e in events if e["event"] == "capacity_request"]
    assert asked["workers"] == 1 and asked["slack_s"] < 0 and asked["world_size"] == 2
    decided = [e for e in events if e["event"] == "capacity_switch"]
    assert [d["market"] for d in decided[:2]] == ["on_demand", "spot"], kinds
    assert decided[0]["slack_s"] < 0 and decided[1]["slack_s"] > decided[1]["margin_s"]
    assert decided[1]["margin_s"] == pytest.approx(
        max(0.01 * DEADLINE_S, 2 * decided[1]["restart_s"]), abs=0.2
    )
    # On a loaded machine the restart back on spot can outlast its margin (twice the mean
    # restart so far; in CI it was 74 s behind after a 4-minute switch back, as the autoscaler
    # had taken the idle spot nodes meanwhile). Back on spot, the group asks again only once
    # behind by more than the margin. Such a request is withdrawn once ahead, or served (one
    # more switch to on-demand), or still stands when the run ends, which withdraws it (the
    # on-demand node leaves, below).
    assert all(
        a["slack_s"] < a["ask_below_s"] == -a["margin_s"] and a["step"] >= decided[1]["step"]
        for a in asked_again
    ), kinds
    withdrawn = [e for e in events if e["event"] == "capacity_withdrawn"]
    assert len(withdrawn) <= len(asked_again), kinds
    assert all(w["slack_s"] > w["margin_s"] for w in withdrawn), withdrawn
    assert len(decided) == 2 or (decided[2]["market"] == "on_demand" and asked_again), kinds
    switches = [e for e in events if e["event"] == "capacity"]  # the driver's, after each end
    assert [(s["market"], s["step"]) for s in switches] == [
        (d["market"], d["step"]) for d in decided
    ]
    groups = [e for e in events if e["event"] == "segment_start"]
    assert len(groups) == 1 + len(decided), kinds
    assert [g["world_size"] for g in groups[:3]] == [2, 3, 2], kinds
    assert [g["price_per_hour"] for g in groups[:3]] == [2.0, 5.0, 2.0]  # on-demand one at $3
    stops = [e.get("why") for e in events if e["event"] == "stop"]
    assert stops == ["capacity"] * len(decided)
    assert read_ledger(run_dir).tolist() == list(range(STEPS * BATCH))

    logs = cli("logs", name, "--address", url).stdout
    assert "asking for on-demand nodes for 1 more worker(s)" in logs
    assert "restarting on on-demand capacity" in logs and "restarting on spot capacity" in logs
    assert "back to spot nodes only; the on-demand nodes are given back" in logs
    added = [line for line in logs.splitlines() if "Adding 1 node(s) of type cpu_on_demand" in line]
    assert 1 <= len(added) <= 1 + len(asked_again), logs[-3000:]  # a node per request at most
    placed = state(url, PLACED_WORKERS.format(submission=name))
    on_demand_groups = sum(d["market"] == "on_demand" for d in decided)
    assert sum("on_demand" in resources for resources in placed) == on_demand_groups, placed

    # Nothing of the run fits on it since the switch back: it leaves on the idle timeout.
    gone_by = time.time() + 120
    while state(url, ALIVE_ON_DEMAND) and time.time() < gone_by:
        time.sleep(5)
    assert state(url, ALIVE_ON_DEMAND) == 0, "the on-demand node stayed after the switch back"


WORKER_NODES = """
from ray.util.state import list_jobs
(job,) = [j.job_id for j in list_jobs(address=dashboard) if j.submission_id == {submission!r}]
workers = list_actors(
    address=dashboard, filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", job)]
)
result = {{w.pid: w.node_id for w in workers if w.state == "ALIVE"}}
"""


def test_a_diloco_run_survives_a_node_kill(local_cluster, storage):
    """`raytrain-lm submit` of two replica groups with `parallel.sync=diloco` (H=4) on the fake
    A100 spot nodes, one group per node (1.5 CPUs a worker), steps paced at 0.5 s. Group 1's
    node is killed (every process of it, as a machine that vanished) once both trained a round:
    group 0 finds it gone at the next sync, takes that round again alone and goes on in the
    same process; the job SUCCEEDS with every position trained exactly once."""
    url = local_cluster["dashboard"]
    name, steps = "diloco-kill", 160
    sets = [
        *TINY,
        "training.progress=true",
        "training.log_every=8",
        f"training.max_steps={steps}",
        f"training.global_batch_size={BATCH}",
        f"training.eval_every={steps}",
        "training.ledger=true",
        "checkpoint.every_steps=80",
        "tracking.enabled=false",
        "scaling.use_gpu=false",
        "scaling.accelerator_type=A100",
        "scaling.capacity=spot",
        "scaling.fault_tolerance=replicas",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
        "scaling.cpus_per_worker=1.5",
        "parallel.sync=diloco",
        "diloco.sync_every=4",
        "fault.max_failures=-1",
        f"name={name}",
    ]
    args = [arg for item in sets for arg in ("--set", item)]
    submitted = cli(
        "submit", *args, "--address", url, "--storage", str(storage), "--job-id", name,
        RAYTRAIN_LM_FAULT="slow-steps:seconds=0.5",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    run_dir = RunDir.of(str(storage / "runs"), name)

    def both_groups_trained(events: list[dict]) -> bool:  # a round committed by both
        # Both starts on record too: under load a group that joins late heals first, and the
        # other may note two participants before the joiner records its start.
        started = {e["group"] for e in events if e["event"] == "replica_start"}
        return started >= {0, 1} and any(
            (e["event"] == "replica_start" and e["participants"] == 2 and not e["healed"])
            or (e["event"] == "replicas_changed" and e["participants"] == 2)
            for e in events
        )

    events_when(run_dir, both_groups_trained, 600)
    starts = [e for e in read_events(run_dir) if e["event"] == "replica_start"]
    pids = {e["group"]: e["pid"] for e in starts}
    nodes = state(url, WORKER_NODES.format(submission=name))
    survivor_node, doomed_node = nodes[str(pids[0])], nodes[str(pids[1])]
    assert survivor_node != doomed_node, nodes
    killed = [
        p.kill() or p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(doomed_node in arg for arg in p.info["cmdline"] or ())
    ]
    assert killed, f"no process of node {doomed_node}"
    events_when(run_dir, lambda events: any(e["event"] == "round_retaken" for e in events), 300)
    stop_pacing(run_dir)
    wait_for_status(url, name, "SUCCEEDED", 600)

    events = read_events(run_dir)
    assert read_ledger(run_dir).tolist() == list(range(steps * BATCH))
    starts = [e for e in events if e["event"] == "replica_start"]
    assert len({e["pid"] for e in starts if e["group"] == 0}) == 1, "the survivor restarted"
    retaken = [e for e in events if e["event"] == "round_retaken"]
    assert retaken and all(e["group"] == 0 and e["step"] % 4 == 0 for e in retaken), retaken
    logs = cli("logs", name, "--address", url).stdout
    assert f"{steps}/{steps} | loss" in logs, logs[-3000:]
