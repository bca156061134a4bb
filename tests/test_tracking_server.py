"""The team's tracking server as a user starts it (`raytrain-lm tracking serve`): a real MLflow
server with its runs and logins in a real PostgreSQL (pgserver), logins on. Who may do what is
asked of the server itself, over HTTP, with the logins the CLI handed out."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import shared_run_overrides
from support.jobs import cli, env
from support.team_server import TeamServer

from raytrain_lm import checkpoint_models
from raytrain_lm.tracking.server import read_env_file

SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"


@pytest.fixture(scope="module")
def team_server(tmp_path_factory):
    """`raytrain-lm tracking serve` in a home of its own, once it says it is ready."""
    server = TeamServer(tmp_path_factory.mktemp("tracking-home"))
    server.start()
    yield server
    if server.process is not None:
        server.stop()  # its database stopped with it


def logins(home: Path, name: str) -> dict[str, str]:
    return read_env_file(home / f"{name}.env")


def test_the_admin_login_is_generated_kept_private_and_strangers_are_refused(team_server):
    url, home = team_server.url, team_server.home
    admin = logins(home, "admin")
    password = admin["MLFLOW_TRACKING_PASSWORD"]
    assert admin["MLFLOW_TRACKING_USERNAME"] == "admin" and len(password) >= 24
    for secret in ("admin.env", "flask_secret", "basic_auth.ini"):
        assert stat.S_IMODE((home / secret).stat().st_mode) == 0o600, secret
    assert password not in (home / "server.log").read_text()
    assert password not in "".join(team_server.said)
    assert requests.get(url + SEARCH, timeout=20).status_code == 401  # anonymous
    assert requests.get(url + SEARCH, auth=("admin", "wrong"), timeout=20).status_code == 401
    assert requests.get(url + SEARCH, auth=("admin", password), timeout=20).status_code == 200


@pytest.fixture(scope="module")
def team(team_server, tmp_path_factory):
    """alice manages experiment `team-a` and has a run in it; bob may only read it. Both
    logins come from `raytrain-lm tracking user`, as the admin hands them out."""
    from mlflow.tracking import MlflowClient

    url, home = team_server.url, team_server.home
    credentials = tmp_path_factory.mktemp("credentials")
    admin = logins(home, "admin")
    for user, rights in (("alice", "MANAGE"), ("bob", "READ")):
        done = cli(
            "tracking", "user", user, "--experiment", "team-a", "--permission", rights,
            "--uri", url, "--credentials-dir", str(credentials), **admin,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"{user}: {rights} on experiment 'team-a'" in done.stdout
        assert stat.S_IMODE((credentials / f"{user}.env").stat().st_mode) == 0o600
    alice, bob = logins(credentials, "alice"), logins(credentials, "bob")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in alice.items():
            patch.setenv(key, value)
        store = MlflowClient(tracking_uri=url)
        experiment_id = store.get_experiment_by_name("team-a").experiment_id
        run_id = store.create_run(experiment_id, run_name="alices").info.run_id
    return {"alice": alice, "bob": bob, "experiment_id": experiment_id, "run_id": run_id}


def test_read_rights_cannot_log_to_or_delete_anothers_experiment(team_server, team, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for key, value in team["bob"].items():
        monkeypatch.setenv(key, value)
    store = MlflowClient(tracking_uri=team_server.url)
    assert store.get_experiment(team["experiment_id"]).name == "team-a"  # reading is allowed
    assert store.get_run(team["run_id"]).info.run_name == "alices"
    for refused in (
        lambda: store.create_run(team["experiment_id"]),
        lambda: store.log_metric(team["run_id"], "loss", 1.0),
        lambda: store.delete_run(team["run_id"]),
        lambda: store.delete_experiment(team["experiment_id"]),
    ):
        with pytest.raises(MlflowException) as raised:
            refused()
        assert raised.value.get_http_status_code() == 403
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", team["alice"]["MLFLOW_TRACKING_PASSWORD"])
    assert (
        MlflowClient(tracking_uri=team_server.url).get_run(team["run_id"]).info.lifecycle_stage
        == "active"
    )


@pytest.mark.parametrize("who", ["bob", "anonymous"])
def test_a_run_without_rights_fails_at_start_in_one_line_leaving_nothing(
    team_server, team, tiny_overrides, tmp_path, who
):
    """`raytrain-lm train` logging to alice's experiment with bob's login (read rights), or
    with none: exit 2, one line naming the experiment or the login, before Ray or any worker
    starts, and no run directory."""
    url = team_server.url
    overrides = [
        *(o for o in tiny_overrides if not o.startswith(("tracking.", "output_dir="))),
        f"tracking.uri={url}",
        "tracking.experiment=team-a",
        f"output_dir={tmp_path / 'runs'}",
        "name=not-allowed",
    ]
    login = team["bob"] if who == "bob" else {}
    variables = {
        k: v for k, v in env(**login).items() if who == "bob" or "MLFLOW_TRACKING" not in k
    }
    ray_temp = tmp_path / "ray-temp"  # where a Ray it started would keep its session
    variables["RAY_TMPDIR"] = str(ray_temp)
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", "train", *(f"--set={o}" for o in overrides)],
        capture_output=True,
        text=True,
        env=variables,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    expected = (
        "user 'bob' has READ rights on experiment 'team-a', and a run needs EDIT"
        if who == "bob"
        else "refused a client without a login (HTTP 401)"
    )
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not ray_temp.exists()  # refused before Ray started, so before any worker
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_later_grant_lets_bob_log_and_a_stale_admin_login_is_refused(
    team_server, team, tmp_path, monkeypatch
):
    """Runs last in this module: bob, now with EDIT, passes the check a run makes; his login
    stays the one he had. A server never starts with an admin login it does not know (MLflow
    made its admin from the first one)."""
    from raytrain_lm.errors import UserError
    from raytrain_lm.tracking.access import check_can_log
    from raytrain_lm.tracking.server import _check_admin_login

    url, admin = team_server.url, logins(team_server.home, "admin")
    done = cli(
        "tracking", "user", "bob", "--experiment", "team-a", "--permission", "EDIT",
        "--uri", url, "--credentials-dir", str(tmp_path), **admin,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bob: EDIT on experiment 'team-a'" in done.stdout and "new user" not in done.stdout
    assert not (tmp_path / "bob.env").exists()
    for key, value in team["bob"].items():
        monkeypatch.setenv(key, value)
    check_can_log(url, "team-a")
    stale = tmp_path / "stale-admin.env"
    stale.write_text("MLFLOW_TRACKING_USERNAME=admin\nMLFLOW_TRACKING_PASSWORD=made-again-later\n")
    with pytest.raises(UserError, match="is not this server's admin"):
        _check_admin_login(url, stale)
    _check_admin_login(url, team_server.home / "admin.env")


def test_a_login_file_is_never_replaced(tmp_path):
    path = tmp_path / "cluster" / "tracking.env"
    made = cli("tracking", "login", str(path), "--artifacts", "s3://bucket/mlflow")
    assert made.returncode == 0, made.stderr
    first = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "RAYTRAIN_LM_TRACKING_ARTIFACTS=s3://bucket/mlflow" in first
    again = cli("tracking", "login", str(path))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"raytrain-lm: error: {path} exists: a login is never replaced (remove it first)"
    ]
    assert path.read_text() == first


def _complete_checkpoints(run_dir: Path) -> int:
    from raytrain_lm.checkpoints import is_complete

    return sum(is_complete(str(path)) for path in run_dir.glob("checkpoint_*"))


def _wait(condition, what: str, process: subprocess.Popen, said: Path, timeout_s=300) -> None:
    """Until `condition()` holds; the run ending first, or a generous bound, fails the test."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {said.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(1)


@pytest.mark.own_ray
def test_a_run_outlives_the_servers_outage_and_loses_nothing(team_server, shared_dirs, tmp_path):
    """Runs last in this module. `raytrain-lm train` logs to the server as the admin; the
    server (MLflow and its PostgreSQL) stops mid-run; the run checkpoints meanwhile; the server
    starts again on the same home and address; the run completes, and every step's loss, every
    evaluation and every checkpoint's model is on the server."""
    from mlflow.tracking import MlflowClient

    from raytrain_lm.run_events.journal import Heartbeat
    from raytrain_lm.trainer.chaos import stop_pacing

    runs = tmp_path / "runs"
    overrides = [
        *(o for o in shared_run_overrides(runs, shared_dirs) if not o.startswith("tracking.")),
        f"tracking.uri={team_server.url}",
        "name=outage",
        "scaling.num_workers=1",
        "training.max_steps=200",
        "training.eval_every=20",
        "checkpoint.every_steps=20",
        "checkpoint.keep_last=2",
    ]
    admin = team_server.login()
    # Paced so that the outage and the restart fall inside the run however slow the machine;
    # released (stop_pacing) once the server is back.
    variables = env(**admin, RAYTRAIN_LM_FAULT="slow-steps:seconds=1")
    said = tmp_path / "train.log"  # a file: a pipe nobody reads meanwhile would fill and block
    with said.open("w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "raytrain_lm.cli", "train", *(f"--set={o}" for o in overrides)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=variables,
        )  # fmt: skip
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in admin.items():
                patch.setenv(key, value)
            store = MlflowClient(tracking_uri=team_server.url)

            # Its chief's heartbeat past step 1, a file: asking the server every second took a
            # fifth of a core from a run already starved on a loaded machine. Ray's start and
            # the data's preparation come first: minutes on a loaded machine.
            def stepping() -> bool:
                beat = Heartbeat.read(runs / "outage")
                return beat is not None and beat.step >= 1

            _wait(stepping, "a step", run, said, timeout_s=900)
            team_server.stop()
            before = _complete_checkpoints(runs / "outage")
            _wait(lambda: _complete_checkpoints(runs / "outage") > before,
                  "a checkpoint during the outage", run, said, timeout_s=600)  # fmt: skip
            team_server.start()
            assert run.poll() is None, "the run ended before the server was back: pace it slower"
            stop_pacing(runs / "outage")
            run.wait(timeout=600)
            output = said.read_text()
            assert run.returncode == 0, output[-3000:]
            summary = json.loads(
                next(line for line in output.splitlines() if line.startswith("summary: "))[9:]
            )
            run_id = summary["mlflow_run_id"]
            assert store.get_run(run_id).info.status == "FINISHED"
            steps = {m.step for m in store.get_metric_history(run_id, "train/loss")}
            assert steps == set(range(1, 201))
            evaluated = sorted(m.step for m in store.get_metric_history(run_id, "val/loss"))
            assert evaluated == list(range(20, 201, 20))
            models = checkpoint_models("outage", runs)
            assert sorted(models.index) == list(range(20, 201, 20))  # pruned ones too
            assert models["kept"].sum() == 2
    finally:
        if run.poll() is None:
            run.kill()
        if team_server.process is None:
            team_server.start()
