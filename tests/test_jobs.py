"""The whole cluster flow on one machine: `raytrain-lm cluster up` (cluster/local.yaml, fake GPU
nodes, token auth), `raytrain-lm submit` of a tiny run that asks for A100 nodes, the autoscaler
launching one, the workers landing on it, SUCCEEDED with the summary in the logs, the node
leaving when idle; clients without the token are refused.

Fake GPUs cannot run CUDA: the run asks for the A100 type with `scaling.use_gpu=false`, so its
CPU workers carry the `accelerator_type:A100` marker and only fit on the fake A100 nodes.
Everything talks to the cluster from subprocesses: this pytest process holds its own Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import TINY

pytestmark = [pytest.mark.cluster, pytest.mark.own_ray]

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    *TINY,
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


ALIVE_WORKER_TYPES = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sorted(
    k for n in nodes if n.state == "ALIVE" for k in n.resources_total if k.startswith("accelerator_type:")
)
"""


@pytest.fixture(scope="module")
def local_cluster():
    # Short, private temp dir: Ray's socket paths must fit in 107 bytes, and `down` ends the
    # processes under this dir only, never other Rays on the machine.
    directory = tempfile.mkdtemp(prefix="rtlm-", dir="/tmp")
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


def test_run_asking_for_a100_scales_up_lands_there_and_scales_down(local_cluster, tmp_path):
    url = local_cluster["dashboard"]
    assert _state(url, ALIVE_WORKER_TYPES) == []  # only the head: no fake GPU node yet
    job = "a100-run"
    sets = [arg for item in [*RUN, "name=a100-run"] for arg in ("--set", item)]
    submitted = _cli(
        "submit",
        *sets,
        "--address",
        url,
        "--storage",
        str(tmp_path),
        "--job-id",
        job,
        "--follow",
        timeout=420,
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert f"submitted job {job}" in submitted.stdout
    assert f"raytrain-lm logs {job} --follow" in submitted.stdout
    assert _cli("status", job, "--address", url).stdout.startswith(f"{job}: SUCCEEDED")
    logs = _cli("logs", job, "--address", url).stdout
    summary = json.loads(
        next(line for line in logs.splitlines() if line.startswith("summary: "))[9:]
    )
    assert summary["run"] == "a100-run" and summary["steps"] == 20
    assert Path(summary["checkpoint"]).is_relative_to(tmp_path)  # relative output moved to storage

    placed = _state(
        url,
        """
nodes = {n.node_id: n for n in list_nodes(address=dashboard, detail=True, limit=100)}
workers = list_actors(address=dashboard, filters=[("class_name", "=", "RayTrainWorker")], limit=100)
result = [sorted(nodes[w.node_id].resources_total) for w in workers]
""",
    )
    assert len(placed) == 2
    for resources in placed:
        assert "accelerator_type:A100" in resources and "spot" in resources

    # Same name again: the job resumes the finished run instead of training anew.
    again = _cli(
        "submit",
        *sets,
        "--address",
        url,
        "--storage",
        str(tmp_path),
        "--job-id",
        f"{job}-2",
        "--follow",
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-3000:]
    assert "already trained to step 20" in _cli("logs", f"{job}-2", "--address", url).stdout

    # idle_timeout_minutes is 0.25 in cluster/local.yaml; allow for the autoscaler's lag
    deadline = time.time() + 120
    while _state(url, ALIVE_WORKER_TYPES) and time.time() < deadline:
        time.sleep(3)
    assert _state(url, ALIVE_WORKER_TYPES) == [], "the A100 node did not scale down when idle"
