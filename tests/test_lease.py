"""One writer per run (runlease.py): the lease protocol on a local folder and on a real
S3-protocol server, without Ray; a second `raytrain-lm train` of a running name refused while
the first trains on untouched; a SIGKILLed holder's claim not standing in a later run's way;
and a finished run started again (a no-op resume) leaving its summary and MLflow record."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import raytrain_lm
from raytrain_lm.clusters.multinode import Background, wait_for_event
from raytrain_lm.config import load_config
from raytrain_lm.rundir import LEASE_DIR, RunDir
from raytrain_lm.runlease import LeaseHeld, LeaseLost, RunLease

TTL, SKEW = 60.0, 15.0


class Clock:
    """A wall clock the test moves: expiry and renewal without waiting for them."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["folder", "bucket"])
def run_dir(request, tmp_path) -> RunDir:
    if request.param == "folder":
        return RunDir.of(tmp_path / "runs", "demo")
    bucket = request.getfixturevalue("s3").new_bucket()
    return RunDir.of(f"{bucket}/runs", "demo")


def _lease(run_dir: RunDir, clock: Clock, **terms) -> RunLease:
    return RunLease(run_dir, "demo", ttl_s=TTL, max_skew_s=SKEW, clock=clock, **terms)


def _claims(run_dir: RunDir) -> list[str]:
    return [n for n in run_dir.list_files(LEASE_DIR) if n.endswith(".json")]


def test_the_lease_protocol(run_dir):
    clock = Clock()
    first = _lease(run_dir, clock).acquire(renew_in_background=False)
    (held,) = _claims(run_dir)
    claim = json.loads(run_dir.read_text(LEASE_DIR, held))
    assert claim["pid"] == os.getpid() and claim["host"] == socket.gethostname()
    assert claim["expires_at"] == clock.now + TTL

    # A second candidate is refused in one line naming the holder, and leaves nothing.
    with pytest.raises(LeaseHeld) as refused:
        _lease(run_dir, clock).acquire(renew_in_background=False)
    message = str(refused.value)
    assert "\n" not in message and f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert message.startswith("run 'demo' is already running")
    assert _claims(run_dir) == [held]
    assert json.loads(run_dir.read_text(LEASE_DIR, held)) == claim  # untouched

    # Renewed well within the TTL, the claim stays live past its first expiry.
    start = clock.now
    clock.now = start + TTL / 2
    assert first.renew()
    clock.now = start + TTL + SKEW + 1
    with pytest.raises(LeaseHeld):
        _lease(run_dir, clock).acquire(renew_in_background=False)

    # Not renewed again (its holder stalled), it is dead once past its expiry and the skew
    # allowance, and no earlier: the next candidate takes the lease and removes it.
    clock.now = start + TTL / 2 + TTL + SKEW  # exactly at expiry + skew: still live
    with pytest.raises(LeaseHeld):
        _lease(run_dir, clock).acquire(renew_in_background=False)
    clock.now += 1
    lost = []
    first.on_lost = lambda: lost.append(True)
    second = _lease(run_dir, clock).acquire(renew_in_background=False)
    assert _claims(run_dir) == [f"{second.claim['id']}.json"]
    first.check()  # nothing known yet: the stalled holder has not come back

    # The stalled holder's renewal comes late: a new candidacy, which finds the new holder.
    assert not first.renew()
    assert lost == [True] and "pid" in first.lost
    with pytest.raises(LeaseLost, match="run 'demo' lost its lease to pid"):
        first.check()
    assert _claims(run_dir) == [f"{second.claim['id']}.json"]
    second.release()
    assert _claims(run_dir) == []

    # A late renewal with nobody else there keeps the lease (a machine that slept).
    third = _lease(run_dir, clock).acquire(renew_in_background=False)
    clock.now += 10 * TTL
    assert third.renew() and third.lost is None
    with pytest.raises(LeaseHeld):
        _lease(run_dir, clock).acquire(renew_in_background=False)
    third.release()

    # Two candidates at once: each lists the other's claim, so whichever settles while both
    # claims stand refuses, withdrawing its own; one that lists after that holds the lease.
    a, b = _lease(run_dir, clock), _lease(run_dir, clock)
    a.write_claim()
    b.write_claim()
    assert [c["id"] for c in a.live_claims()] == [b.claim["id"]]
    assert [c["id"] for c in b.live_claims()] == [a.claim["id"]]
    assert [c["id"] for c in a.settle()] == [b.claim["id"]]
    assert _claims(run_dir) == [f"{b.claim['id']}.json"]
    assert b.settle() == []
    with pytest.raises(LeaseHeld):
        _lease(run_dir, clock).acquire(renew_in_background=False)
    b.release()
    assert _claims(run_dir) == []

    # The lease that made the folders removes them at its release, once they are empty.
    first.release()
    if not run_dir.remote:
        assert not Path(run_dir.parent).exists()


def test_a_patient_candidate_waits_for_a_released_lease_and_refuses_a_renewed_one(tmp_path):
    run_dir = RunDir.of(tmp_path / "runs", "demo")
    holder = RunLease(run_dir, "demo", renew_every_s=0.05).acquire()  # renewing, TTL 60 s
    with pytest.raises(LeaseHeld):
        RunLease(run_dir, "demo", patience_s=0.5).acquire()

    looked = threading.Event()

    def clock() -> float:  # the real clock, telling the test that the waiter looked
        looked.set()
        return time.time()

    waiter = Background(lambda: RunLease(run_dir, "demo", patience_s=300, clock=clock).acquire())
    assert looked.wait(120)  # it saw the live claim and waits
    assert waiter.running
    holder.release()
    taken = waiter.wait(120)
    assert _claims(run_dir) == [f"{taken.claim['id']}.json"]
    taken.release()


def test_a_sigkilled_holders_lease_does_not_stop_a_later_run(learned_run, tmp_path):
    """A process holding the run's lease is SIGKILLed: its claim stays behind, and the same
    command run again goes on (its holder is gone; elsewhere its claim would expire)."""
    runs = tmp_path / "runs"
    shutil.copytree(learned_run["output_dir"] / "learns", runs / "learns")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from raytrain_lm.runlease import RunLease\n"
            "from raytrain_lm.rundir import RunDir\n"
            "RunLease(RunDir(sys.argv[1]), 'learns').acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(3600)\n",
            str(runs / "learns"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid} on"):
            raytrain_lm.train(_overrides_for(learned_run, runs), sample=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    (left,) = _claims(RunDir(str(runs / "learns")))
    assert json.loads((runs / "learns" / LEASE_DIR / left).read_text())["pid"] == holder.pid

    summary = raytrain_lm.train(_overrides_for(learned_run, runs), sample=False)
    assert summary["steps"] == 40
    assert not (runs / "learns" / LEASE_DIR).exists()  # the dead claim removed, then its own


def _overrides_for(learned_run: dict, output_dir: Path):
    overrides = [o for o in learned_run["overrides"] if not o.startswith("output_dir=")]
    return load_config(None, [*overrides, f"output_dir={output_dir}"])


def test_a_finished_run_started_again_changes_nothing(learned_run, tmp_path):
    """A no-op resume (on a copy of the session's finished run, its MLflow run shared) leaves
    summary.json and the MLflow record as the run finished, and returns that summary; a run
    that stopped at its last step is published as finished, with the wall time it trained."""
    runs = tmp_path / "runs"
    shutil.copytree(learned_run["output_dir"] / "learns", runs / "learns")
    summary_file = runs / "learns" / "summary.json"
    written = summary_file.read_bytes()
    uri = next(o.split("=", 1)[1] for o in learned_run["overrides"] if o.startswith("tracking."))
    client = MlflowClient(tracking_uri=uri)
    run_id = learned_run["summary"]["mlflow_run_id"]

    def record() -> tuple:
        run = client.get_run(run_id)
        artifacts = sorted(a.path for a in client.list_artifacts(run_id))
        history = len(client.get_metric_history(run_id, "goodput/restarts"))
        return run.info.status, run.info.end_time, run.data.metrics, artifacts, history

    before = record()
    again = raytrain_lm.train(_overrides_for(learned_run, runs), sample=False)
    assert summary_file.read_bytes() == written
    assert again == json.loads(written) | {"checkpoint": again["checkpoint"]}
    assert again["checkpoint"].startswith(str(runs / "learns" / "checkpoint_"))
    assert record() == before

    # Stopped at its last step (a stop that came at the end): published as finished now,
    # with the wall time of the run that trained it, not this invocation's seconds.
    stopped = json.loads(written) | {"stopped": True, "wall_s": 12345.6}
    summary_file.write_text(json.dumps(stopped))
    overrides = [o for o in learned_run["overrides"] if not o.startswith("output_dir=")]
    untracked = load_config(None, [*overrides, f"output_dir={runs}", "tracking.enabled=false"])
    published = raytrain_lm.train(untracked, sample=False)
    assert published["stopped"] is False and published["wall_s"] == 12345.6
    assert json.loads(summary_file.read_text()) == published


def test_a_second_train_of_a_running_name_is_refused_and_the_first_finishes_untouched(
    ray_session, tiny_overrides, tmp_path, monkeypatch
):
    """`make demo` twice: the second `raytrain-lm train` of the name is refused in one line
    naming the first (exit 2), while the first, held at its first step, waits; released, the
    first finishes with one MLflow point per step and its checkpoints, as if alone."""
    from raytrain_lm.checkpoints import complete_checkpoints, read_state
    from raytrain_lm.run_events.journal import read_events
    from raytrain_lm.trainer import chaos

    overrides = [
        *tiny_overrides,
        "name=twice",
        "scaling.num_workers=1",
        "training.max_steps=2",
        "training.eval_every=2",
        "checkpoint.every_steps=1",
    ]
    run_dir = tmp_path / "runs" / "twice"
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=3600")  # held until released
    first = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    wait_for_event(run_dir, lambda e: e["event"] == "segment_start", 600, still_running=first)
    kept = ("config.yaml", "tracking.json", "tokenizer.json")
    written = {name: (run_dir / name).read_bytes() for name in kept}

    env = {k: v for k, v in os.environ.items() if k != chaos.ENV_VAR}
    env["RAY_ADDRESS"] = ray_session.get_runtime_context().gcs_address  # were it to train
    command = [sys.executable, "-m", "raytrain_lm.cli", "train", *[f"--set={o}" for o in overrides]]
    second = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr
    (error,) = [line for line in second.stderr.splitlines() if line.startswith("raytrain-lm:")]
    assert error.startswith("raytrain-lm: error: run 'twice' is already running: ")
    assert f"pid {os.getpid()} on {socket.gethostname()}" in error, error
    assert first.running
    assert {name: (run_dir / name).read_bytes() for name in kept} == written
    assert [e["event"] for e in read_events(run_dir)].count("job_start") == 1

    chaos.stop_pacing(run_dir)
    summary = first.wait(600)
    assert summary["steps"] == 2 and not summary["stopped"]
    assert {name: (run_dir / name).read_bytes() for name in kept} == written
    client = MlflowClient(
        tracking_uri=next(o[13:] for o in overrides if o.startswith("tracking.uri="))
    )
    history = client.get_metric_history(summary["mlflow_run_id"], "train/loss")
    assert sorted(m.step for m in history) == [1, 2]  # one point per step
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert len(client.search_runs(experiments, "attributes.run_name = 'twice'")) == 1
    assert [read_state(c).step for c in complete_checkpoints(run_dir)] == [1, 2]
    assert not (run_dir / LEASE_DIR).exists()
