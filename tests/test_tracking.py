"""Tracking that survives its server: buffering, retry, spooling, redaction."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from mlflow.tracking import MlflowClient
from support.noise import noise_in

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.errors import UserError
from raytrain_lm.redaction import REDACTED, looks_secret, redact
from raytrain_lm.runtime import free_port
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.trainer import chaos


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("hf_token", True),
        ("data.auth.password", True),
        ("aws_secret_access_key", True),
        ("apiKey", True),
        ("storage.api-key", True),
        ("data.shard_tokens", False),
        ("training.sample_tokens", False),
        ("data.tokenizer.kind", False),
        ("data.tokenizer.path", False),
        ("model.n_embd", False),
    ],
)
def test_secret_looking_keys(key, secret):
    assert looks_secret(key) is secret
    assert (redact({key: "v"})[key] == REDACTED) is secret
    assert (redact({key: 918273})[key] == REDACTED) is secret  # numbers can be credentials
    assert redact({key: "", "x": None, "flag": True}) == {key: "", "x": None, "flag": True}


def test_giving_up_on_an_unreachable_store_is_one_user_error():
    """After `tracking.start_wait_s` the run is refused in one line naming the store and the
    setting, instead of MLflow's traceback."""
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        MLflowTracker.start("http://127.0.0.1:1", "nowhere", "refused", None, wait_s=1)
    message = str(err.value)
    assert "tracking store http://127.0.0.1:1 unreachable" in message
    assert "within 1 s (tracking.start_wait_s)" in message and "\n" not in message
    assert time.monotonic() - started < 60


def test_a_local_store_that_cannot_exist_is_refused_at_once(tmp_path):
    """An sqlite file in a folder that does not exist is a mistake, not an outage: no wait."""
    started = time.monotonic()
    uri = f"sqlite:///{tmp_path}/missing/mlflow.db"
    with pytest.raises(UserError, match=f"folder {tmp_path}/missing does not exist"):
        MLflowTracker.start(uri, "nowhere", "refused", None, wait_s=600)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "missing").exists()


def test_a_run_whose_store_stays_unreachable_is_refused_leaving_nothing(
    ray_session, tiny_overrides, tmp_path
):
    """Through `train` itself: one UserError naming the store, and no run directory (no
    config.yaml, no tracking record) left behind to confuse the next attempt."""
    overrides = [
        *(o for o in tiny_overrides if not o.startswith("tracking.uri=")),
        "tracking.uri=http://127.0.0.1:1",
        "tracking.start_wait_s=1",
        "name=unreachable",
    ]
    with pytest.raises(UserError, match="tracking store http://127.0.0.1:1 unreachable"):
        raytrain_lm.train(load_config(None, overrides), sample=False)
    assert not (tmp_path / "runs" / "unreachable").exists()


def test_ctrl_c_while_waiting_for_the_store_says_nothing_started(
    ray_session, tiny_overrides, tmp_path
):
    """`raytrain-lm train` against a tracking server that is down (its port closed): a warning,
    then a one-line status while it waits (how long, how long left, how to stop or skip);
    Ctrl-C then says that nothing started and nothing was written, in one line, and exits as
    after any Ctrl-C (130), without a traceback and without a file of the run."""
    store = f"http://127.0.0.1:{free_port()}"
    overrides = [
        *(o for o in tiny_overrides if not o.startswith("tracking.uri=")),
        f"tracking.uri={store}",
        "name=waits",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    command = [sys.executable, "-m", "raytrain_lm.cli", "train"]
    driver = subprocess.Popen(
        [*command, *(arg for item in overrides for arg in ("--set", item))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: list[str] = []
    status_shown = threading.Event()

    def read() -> None:
        for line in driver.stdout:
            lines.append(line.rstrip("\n"))
            if "still waiting for tracking store" in line:
                status_shown.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert status_shown.wait(timeout=300), "\n".join(lines[-30:])
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=120) == 130, "\n".join(lines[-30:])
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    reader.join(timeout=30)
    output = "\n".join(lines)
    warning, status = (
        next(line for line in lines if text in line)
        for text in (f"tracking store {store} unreachable", "still waiting")
    )
    assert "waiting up to 600 s to open run 'waits' (tracking.start_wait_s)" in warning
    assert re.fullmatch(
        rf"\[raytrain-lm\] still waiting for tracking store {re.escape(store)}: \d+ s waited, "
        r"\d+ s left; Ctrl-C stops, tracking.enabled=false runs without tracking",
        status,
    ), status
    assert lines[-1] == (
        f"raytrain-lm: interrupted while waiting for tracking store {store}: 'waits' did not "
        "start and nothing of it was written; start the store (or set tracking.enabled=false) "
        "and run the command again"
    ), output[-3000:]
    assert "Traceback" not in output and "resume" not in output, output[-3000:]
    assert noise_in(output) == [], output[-3000:]
    assert [p for p in (tmp_path / "runs").rglob("*") if p.is_file()] == []


@pytest.fixture
def server(mlflow_server):
    """The session's server (conftest.py), running again after the test whatever happened."""
    yield mlflow_server
    if mlflow_server.process is None:
        mlflow_server.start()


def test_tracker_buffers_while_the_server_is_down(server):
    """Params and tags are redacted; metrics, params and tags logged while the server is down
    are sent when it is back; flush never raises and returns promptly meanwhile. A run opened
    during the outage (a restarted trial) waits for the server and reopens the same MLflow
    run; a new one is created once the server answers."""
    tracker = MLflowTracker.start(server.uri, "down", "buffered", None, tags={"db_password": "x"})
    tracker.log_params({"optim.lr": 0.1, "hf_token": "hf_abc"})
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.flush()
    server.stop()
    with pytest.raises(UserError, match="unreachable: could not open run 'no-wait' within 0 s"):
        MLflowTracker.start(server.uri, "down", "no-wait", None, wait_s=0)
    opened: dict = {}

    def open_run(key: str, run_id: str | None) -> None:
        opened[key] = MLflowTracker.start(
            server.uri, "down", key, run_id, tags={"phase": "outage"}, wait_s=300
        )

    openers = [
        threading.Thread(target=open_run, args=("buffered", tracker.run_id)),
        threading.Thread(target=open_run, args=("fresh", None)),
    ]
    for thread in openers:
        thread.start()
    for step in range(2, 120):
        tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
    tracker.log_params({"late.param": 3})
    tracker.set_tags({"late_tag": "yes"})
    started = time.monotonic()
    tracker.flush()  # the store is down: one failed attempt, no exception
    assert time.monotonic() - started < 30
    assert all(thread.is_alive() for thread in openers) and not opened  # waiting, not failed
    server.start()
    tracker.finish()
    for thread in openers:
        thread.join(timeout=120)
    for reopened in opened.values():
        reopened.finish()
    client = MlflowClient(tracking_uri=server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"optim.lr": "0.1", "hf_token": REDACTED, "late.param": "3"}
    assert run.data.tags["db_password"] == REDACTED and run.data.tags["late_tag"] == "yes"
    steps = sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss"))
    assert steps == list(range(1, 120))
    assert opened["buffered"].run_id == tracker.run_id  # the same run, reopened
    fresh = client.get_run(opened["fresh"].run_id)
    assert fresh.info.run_name == "fresh" and fresh.data.tags["phase"] == "outage"
    experiment = client.get_experiment_by_name("down").experiment_id
    names = [r.info.run_name for r in client.search_runs([experiment], max_results=100)]
    assert sorted(names) == ["buffered", "fresh"]  # nothing opened twice


def test_a_chief_that_hands_over_stores_its_steps_first(server):
    """A replica groups' chief logs step 2 while the store is away, so the row waits out the
    tracker's backoff. The store comes back and a group that joined becomes chief: as the old
    chief takes its new place it stores what it logged (trainer/groups/membership.py), before
    the new chief logs the steps the store lacks, so no step is logged twice."""
    from raytrain_lm.trainer.groups.membership import Membership

    old = MLflowTracker.start(server.uri, "handover", "chief", None)
    new = MLflowTracker.start(server.uri, "handover", "chief", old.run_id)
    old.log_metrics({"train/loss": 1.0}, step=1)
    old.flush()
    server.stop()
    old.log_metrics({"train/loss": 0.5}, step=2)
    old.flush()  # one failed attempt: the row waits for the store and a retry
    assert old.stored_through == 1
    server.start()
    members = Membership(group=0, groups=2)
    members.hands_over = old.flush  # as a replica group's tracker is wired (groups/replicas.py)
    members.participant = 1  # the quorum that put the joiner first
    assert old.stored_through == 2
    new.log_missing([(1, {"train/loss": 1.0}), (2, {"train/loss": 0.5})])
    new.finish()
    old.finish(status=None)
    history = MlflowClient(tracking_uri=server.uri).get_metric_history(old.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2]


def test_training_run_survives_a_tracking_outage(
    ray_session, tiny_overrides, server, tmp_path, monkeypatch
):
    """Stop the server while a run trains and start it again later: the run completes and
    every step's metrics arrive."""
    monkeypatch.setenv("RAYTRAIN_LM_FAULT", "slow-steps:seconds=0.25")
    overrides = [
        *(o for o in tiny_overrides if not o.startswith("tracking.uri=")),
        f"tracking.uri={server.uri}",
        "name=outage",
        "scaling.num_workers=1",
        "training.max_steps=80",
        "training.eval_every=20",
        "checkpoint.every_steps=20",
    ]
    done: dict = {}

    def train() -> None:
        try:
            done["summary"] = raytrain_lm.train(load_config(None, overrides), sample=False)
        except BaseException as exc:  # reported by the assertion below
            done["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    client = MlflowClient(tracking_uri=server.uri)
    deadline = time.time() + 240
    run_id = None
    while time.time() < deadline and thread.is_alive():
        found = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            "attributes.run_name = 'outage'",
        )
        if found and client.get_metric_history(found[0].info.run_id, "train/loss"):
            run_id = found[0].info.run_id
            break
        time.sleep(1)
    assert run_id, done
    server.stop()
    time.sleep(8)  # several steps and a checkpoint flush with nowhere to send metrics
    assert thread.is_alive(), done
    server.start()
    chaos.stop_pacing(tmp_path / "runs" / "outage")  # the rest of the run at full speed
    thread.join(timeout=300)
    assert "error" not in done, done.get("error")
    summary = done["summary"]
    assert summary["steps"] == 80 and summary["mlflow_run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = sorted({m.step for m in client.get_metric_history(run_id, "train/loss")})
    assert steps == list(range(1, 81))
    val = sorted(m.step for m in client.get_metric_history(run_id, "val/loss"))
    assert val == [20, 40, 60, 80]
