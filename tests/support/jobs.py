"""Talking to a `raytrain-lm cluster up` cluster from tests, as a user would: the CLI and the
state API in subprocesses (the test process holds a Ray of its own), job logs and events."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer.driver.stopping import STOP_ACKNOWLEDGED
from support.noise import noise_in

ROOT = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    """This environment for a client process: no Ray address or token settings of the test
    process's own Ray, this venv's scripts on the PATH."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    variables.pop("RAY_ADDRESS", None)
    variables["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{variables.get('PATH', '')}"
    variables.update(extra)
    return variables


def cli(*args: str, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(**extra_env),
        timeout=timeout,
    )


# A variable a test gives `cluster up`, so that every process of that cluster carries it.
TEST_CLUSTER_ENV = "RAYTRAIN_LM_TEST_CLUSTER"


def processes_of(directory: str, tag: dict[str, str]) -> list[str]:
    """The command lines of running processes that name `directory` or carry `tag` in their
    environment (zombies, which run nothing, aside)."""
    import psutil

    (key, value), left = next(iter(tag.items())), []
    for process in psutil.process_iter(["cmdline", "environ", "status"]):
        info = process.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        command = " ".join(info["cmdline"] or ())
        if directory in command or (info["environ"] or {}).get(key) == value:
            left.append(command)
    return left


def mfu_per_token_ratio(logs: str, step: str, figures: dict) -> float:
    """A run's summary MFU per token/s (`figures`: one type's) over its progress line's at
    `step` ("20/20"): 1 within the line's rounding when both take the same devices' peaks, as
    they differ only by their tokens/s (the run's, the last interval's)."""
    shown = re.search(rf" {step} \| .*\| ([\d.]+)k tok/s \| MFU ([\d.]+)%", logs)
    assert shown and float(shown.group(2)) > 0, shown
    tokens_per_s, mfu = 1e3 * float(shown.group(1)), float(shown.group(2)) / 100
    return (figures["mfu"] / figures["tokens_per_s"]) / (mfu / tokens_per_s)


def state(dashboard: str, code: str) -> object:
    """Runs `code` (which sets `result`) against the cluster's state API in a subprocess."""
    script = (
        "import json\nfrom ray.util.state import list_actors, list_nodes\n"
        f"dashboard = {dashboard!r}\n{code}\nprint(json.dumps(result))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env(RAY_AUTH_MODE="token"),
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

# Where Ray Data's cluster-lifetime actors live: the head's node, or another's.
RAY_DATA_ACTORS_ON_HEAD = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
head = {n.node_id for n in nodes if n.is_head_node}
names = ("_StatsActor", "ActorLocationTracker")
actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
result = sorted((a.class_name, a.node_id in head) for a in actors if a.class_name in names)
"""


def submit(url: str, storage: Path, job: str, *args: str, timeout: float) -> str:
    """Submits and follows a job to its end; returns its logs."""
    done = cli(
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
    # What the user reads of the submit and the job it follows: none of Ray's notes.
    assert noise_in(done.stdout + done.stderr) == [], done.stdout[-3000:] + done.stderr[-3000:]
    assert f"raytrain-lm logs {job} --follow" in done.stdout
    assert cli("status", job, "--address", url).stdout.startswith(f"{job}: SUCCEEDED")
    return cli("logs", job, "--address", url).stdout


def submit_raw(url: str, job: str, entrypoint: str) -> None:
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
        env=env(RAY_AUTH_MODE="token"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


ALIVE_CPU_NODES = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sum(1 for n in nodes if n.state == "ALIVE" and "cpu_node" in n.resources_total)
"""


def wait_for_log(url: str, job: str, text: str, timeout: float) -> None:
    """Follows the job's log (one process, not a poll: each CLI call costs a loaded 2-core
    machine seconds of CPU) until `text` appears; fails at once if the job ends first."""
    follow = subprocess.Popen(
        [sys.executable, "-m", "raytrain_lm.cli", "logs", job, "--address", url, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env(),
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


def wait_for_status(url: str, job: str, status: str, timeout: float) -> float:
    started = time.time()
    while not cli("status", job, "--address", url).stdout.startswith(f"{job}: {status}"):
        assert time.time() - started < timeout, cli("logs", job, "--address", url).stdout[-3000:]
        time.sleep(1)
    return time.time() - started


ALIVE_ON_DEMAND = """
nodes = list_nodes(address=dashboard, detail=True, limit=100)
result = sum(1 for n in nodes if n.state == "ALIVE" and "on_demand" in n.resources_total)
"""


def events_when(run_dir, done, timeout: float) -> list[dict]:
    started = time.time()
    while True:
        events = read_events(run_dir)
        if done(events):
            return events
        assert time.time() - started < timeout, [e["event"] for e in events][-20:]
        time.sleep(2)
