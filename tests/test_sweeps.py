"""Sweeps: Tune launching tiny Ray Train runs, tracked in MLflow (a real server and sqlite)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY
from mlflow.tracking import MlflowClient
from support.noise import noise_in
from support.sweep_files import write_sweep

import raytrain_lm
from raytrain_lm import audit, cli
from raytrain_lm.config import RunConfig
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir
from raytrain_lm.runtime import check_schedulable, ensure_ray
from raytrain_lm.sweeps import (
    SWEEP_FILE,
    TAG_PBT_DONOR,
    TAG_PBT_VALUES,
    TAG_TRIAL,
    TRIALS_DIR,
    TrialRuns,
    derive_max_concurrent,
    load_sweep,
    trial_starts,
)
from raytrain_lm.sweeps.search import TRIAL_CPU

ROOT = Path(__file__).resolve().parents[1]


def _children(uri: str, record_dir: Path | str) -> tuple[MlflowClient, list, object]:
    record = json.loads(RunDir(str(record_dir)).read_text(SWEEP_FILE))
    runs = TrialRuns(record["tracking_uri"], record["parent_run_id"])
    client = MlflowClient(tracking_uri=uri)
    return client, runs.children(), client.get_run(record["parent_run_id"])


def _steps(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted({m.step for m in client.get_metric_history(run_id, key)})


# ------------------------------------------------------------------ the file, without Ray


def test_a_sweep_no_trial_of_which_fits_a_local_ray_is_refused():
    """A local Ray must hold one trial at its smallest worker group, with Ray Data and the
    trial's Tune actor (`check_schedulable`, which `ensure_ray` runs for a sweep); how many
    trials then run side by side counts their largest groups, at least one."""
    path = ROOT / "experiments/sweeps/lr_width.yaml"
    base = RunConfig.model_validate(load_sweep(path).base)
    # 1 worker x 1 CPU + 1 CPU for Ray Data + the trial's Tune actor: 2.01 CPUs
    with pytest.raises(UserError, match=r"actor needs 2\.01 CPUs, the cluster has 2$"):
        check_schedulable(base.scaling, {"CPU": 2.0}, extra_cpus=TRIAL_CPU)
    # an autoscaling cluster may still add the nodes: one at a time until it does
    check_schedulable(base.scaling, {"CPU": 2.0}, fixed_size=False, extra_cpus=TRIAL_CPU)
    assert derive_max_concurrent(base, {"CPU": 2.0}, gpu=False) == 1
    check_schedulable(base.scaling, {"CPU": 3.0}, extra_cpus=TRIAL_CPU)
    assert derive_max_concurrent(base, {"CPU": 3.0}, gpu=False) == 1
    assert derive_max_concurrent(base, {"CPU": 7.0}, gpu=False) == 3
    for gpus in ("scaling.use_gpu=true", "scaling.accelerator_type=A100"):
        scaling = RunConfig.model_validate(load_sweep(path, [gpus]).base).scaling
        with pytest.raises(UserError, match=r"need 1 GPUs, the cluster has 0$"):
            check_schedulable(scaling, {"CPU": 8.0}, extra_cpus=TRIAL_CPU)
    # Elastic, 1 to 4 workers, on 3 CPUs: a trial trains with 1 worker, one trial at a time.
    elastic = ["scaling.min_workers=1", "scaling.max_workers=4", "training.global_batch_size=24"]
    elastic = RunConfig.model_validate(load_sweep(path, elastic).base)
    check_schedulable(elastic.scaling, {"CPU": 3.0}, extra_cpus=TRIAL_CPU)
    assert derive_max_concurrent(elastic, {"CPU": 3.0}, gpu=False) == 1


def test_a_reused_ray_must_leave_room_for_the_trials_actor(ray_session, monkeypatch):
    """`ensure_ray` checks a running local Ray with the CPUs a sweep adds for its trial's
    actor: workers and Ray Data taking every CPU leave the actor none."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # not a joined (autoscaling) cluster
    cpus = int(ray_session.cluster_resources()["CPU"])
    whole = {"num_workers": 1, "cpus_per_worker": cpus - 1, "data_cpus": 1}
    scaling = RunConfig.model_validate({"scaling": whole}).scaling
    ensure_ray(scaling)  # the workers and Ray Data alone fit
    with pytest.raises(UserError, match=f"needs {cpus + TRIAL_CPU:g} CPUs, the cluster has"):
        ensure_ray(scaling, extra_cpus=TRIAL_CPU)


_OWN_RAY = """
import json, os, sys
import ray
from raytrain_lm.config import RunConfig
from raytrain_lm.sweeps import connect_ray, load_sweep

sweep = load_sweep(sys.argv[1])
gpu, trials = connect_ray(sweep, RunConfig.model_validate(sweep.base))
auth = os.environ.get("RAY_AUTH_MODE")  # what Ray set, starting its cluster
print(json.dumps({"cpus": ray.cluster_resources()["CPU"], "gpu": gpu, "trials": trials, "auth": auth}))
"""


@pytest.mark.own_ray
def test_a_sweep_that_starts_its_own_ray_leaves_room_for_its_trial(tmp_path):
    """`raytrain-lm sweep` with no Ray running starts one for the machine. Sized for the run
    alone (2 CPUs here) the trial's own actor left Ray Data no CPU and the first trial hung."""
    # A user's shell: no Ray address, and no auth mode (the test session's Ray sets one here).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k != "RAY_AUTH_MODE"}
    result = subprocess.run(
        [sys.executable, "-c", _OWN_RAY, str(ROOT / "experiments/sweeps/lr_width.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    started = json.loads(result.stdout.strip().splitlines()[-1])
    # Token authentication on, as Ray turns it on for a new local Ray, without its notice.
    assert started["auth"] == "token" and noise_in(result.stderr) == [], result.stderr
    # 1 worker x 1 CPU + 1 for Ray Data + 0.01 for the trial's actor, on at least 2 cores
    assert started["cpus"] == max(3, os.cpu_count()) and not started["gpu"]
    assert started["trials"] == int(started["cpus"] // 2.01)


# ------------------------------------------------------------------ sweeps on the session Ray


def _starts(sweep_dir: Path | str, run_name: str) -> int:
    return len(trial_starts(sweep_dir, run_name))


def _interrupt_once_a_trial_finished_and_another_trains(
    path: Path, uri: str, env: dict[str, str]
) -> dict[str, int]:
    """Runs `raytrain-lm sweep path` and SIGINTs it while one trial has finished and another
    is training past its first checkpoint; returns the finished trials' MLflow end times."""
    driver = subprocess.Popen(
        [sys.executable, "-m", "raytrain_lm.cli", "sweep", str(path)],
        env=env,
        cwd=path.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sweep_dir = path.parent / "runs" / path.stem
    trials_dir = sweep_dir / TRIALS_DIR
    finished: dict[str, int] = {}
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not finished:
            assert driver.poll() is None, driver.stdout.read().decode()[-4000:]
            # Files first (cheap, polled often): a trial past its first checkpoint and not done.
            folders = [d for d in trials_dir.iterdir() if d.is_dir()] if trials_dir.is_dir() else []
            training = {
                d.name
                for d in folders
                if list(d.glob("checkpoint_*/COMPLETE*")) and not (d / "summary.json").exists()
            }
            if training:
                _, children, _ = _children(uri, sweep_dir)
                if any(
                    r.info.run_name in training and r.info.status == "RUNNING" for r in children
                ):
                    finished = {
                        r.info.run_name: r.info.end_time
                        for r in children
                        if r.info.status == "FINISHED"
                    }
            time.sleep(0.2)
        assert finished, "never saw a finished trial next to a running one"
        driver.send_signal(signal.SIGINT)
        output = driver.communicate(timeout=180)[0].decode()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 130, output[-4000:]
    assert "run the same command again to resume" in output
    # What the user reads: a line per trial event, none of Tune's tables or Ray's notes.
    assert noise_in(output) == [], output[-4000:]
    assert re.search(
        r"^\[raytrain-lm\] trial \w+ started: model.n_embd=\d+, optim.lr=", output, re.M
    )
    assert re.search(r"^\[raytrain-lm\] trial \w+ finished at step 6: val_loss \d", output, re.M)
    return finished


def test_asha_sweep_interrupted_then_restored_on_a_tracking_server(
    ray_session, tiny_overrides, tmp_path, mlflow_server
):
    """3 trials, ASHA, against a real MLflow server. The driver (`raytrain-lm sweep`) is
    interrupted (SIGINT) while one trial has finished and another trains; then the same sweep
    runs again: the finished trial is not rerun, the interrupted one resumes from its
    checkpoint, the last one runs. In the end each trial is one complete child run of the
    sweep's run, none left RUNNING, and `sweep report` draws the sweep."""
    overrides = [o for o in tiny_overrides if not o.startswith("tracking.uri=")]
    path = write_sweep(
        tmp_path,
        [*overrides, f"tracking.uri={mlflow_server.uri}", "tracking.experiment=sweeps"],
        name="asha3",
        num_samples=3,
        max_concurrent_trials=1,
        seed=0,
        # ASHA may stop a trial only at its last report: a trial stopped at its first
        # checkpoint (seed 0 gives the later trials low learning rates) would leave nothing
        # to interrupt and resume.
        scheduler={"kind": "asha", "grace_period": 6},
    )
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        # Steps 3-6 of a trial (after its first checkpoint) leave 12 s to interrupt it, even on
        # a loaded machine, where Tune takes seconds to act on a SIGINT.
        "RAYTRAIN_LM_FAULT": "slow-steps:seconds=3",
    }
    finished_before = _interrupt_once_a_trial_finished_and_another_trains(
        path, mlflow_server.uri, env
    )
    sweep_dir = tmp_path / "runs" / "asha3"
    _, children, _ = _children(mlflow_server.uri, sweep_dir)
    assert not [r for r in children if r.info.status == "RUNNING"]  # interrupted runs: KILLED

    ctrl_c = signal.getsignal(signal.SIGINT)
    summary = raytrain_lm.sweep(path)  # the same command again: restores
    assert summary["trials"] == 3 and summary["errored"] == 0 and not summary["interrupted"]
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Tune's handler does not outlive it
    records = audit.read(tmp_path)  # the first start and this one, the same sweep each time
    assert [(r["action"], r["run"]) for r in records] == [("sweep", "asha3")] * 2
    assert records[0]["config_digest"] == records[1]["config_digest"]

    client, children, parent = _children(mlflow_server.uri, sweep_dir)
    assert parent.info.status == "FINISHED" and parent.data.tags["raytrain_lm.sweep"] == "asha3"
    assert "best/val_loss" in parent.data.metrics
    assert "report.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    trial_ids = [r.data.tags[TAG_TRIAL] for r in children]
    assert len(children) == 3 and len(set(trial_ids)) == 3  # each trial exactly once
    all_runs = client.search_runs([parent.info.experiment_id], max_results=100)
    assert len(all_runs) == 4  # the parent and its 3 children, nothing else
    trials_dir = sweep_dir / TRIALS_DIR
    resumed = 0
    for run in children:
        name = run.info.run_name
        assert run.info.status == "FINISHED", run.info
        assert name == f"asha3-{run.data.tags[TAG_TRIAL]}"
        tags, params = run.data.tags, run.data.params
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["accelerator_type"] == "cpu" and tags["spot"] == "false"
        assert tags["ray.job_id"] and len(tags["mlflow.source.git.commit"]) == 40
        assert 1e-3 <= float(params["optim.lr"]) <= 1e-2
        assert params["model.n_embd"] in ("32", "48") and params["model.n_layer"] == "2"
        last = _steps(client, run.info.run_id)[-1]
        assert _steps(client, run.info.run_id) == list(range(1, last + 1))  # history, no gaps
        assert _steps(client, run.info.run_id, "val/loss") == list(range(2, last + 1, 2))
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "tokenizer.json", "loss_curve.png"} <= artifacts, artifacts
        stopped_early = tags.get("raytrain_lm.stopped_early") == "true"
        assert stopped_early == (last < 6), (name, last)  # Tune's stop may come after step 6
        if not stopped_early:
            final = {a.path for a in client.list_artifacts(run.info.run_id, "final")}
            assert "final/model.safetensors" in final
        if name in finished_before:
            assert _starts(sweep_dir, name) == 1, name  # not rerun
            assert run.info.end_time == finished_before[name]
        elif _starts(sweep_dir, name) == 2:  # the interrupted trial, started again
            events = read_events(trials_dir / name)
            restored = [e["restored_step"] for e in events if e["event"] == "segment_start"]
            assert restored[0] == 0 and restored[-1] > 0, restored  # from its checkpoint
            resumed += 1
    assert resumed == 1
    ranked = [r["val_loss"] for r in summary["ranked"]]
    assert ranked == sorted(ranked) and len(ranked) == 3

    out = tmp_path / "report.png"
    code = cli.run(
        ["sweep", "report", "asha3", "--output-dir", str(tmp_path / "runs"), "--out", str(out)]
    )
    assert code == 0 and out.stat().st_size > 10_000


def test_a_user_error_in_a_trial_reaches_the_caller_alone(ray_session, tiny_overrides, tmp_path):
    """A trial refused by its own run (its data.prepared is no prepared dataset) fails in its
    Tune actor; the sweep's caller gets that UserError, one line, not Tune's summary of an
    errored trial, once the sweep's MLflow runs are ended."""
    missing = tmp_path / "not-prepared"
    path = write_sweep(
        tmp_path,
        [*tiny_overrides, "fault.max_failures=0"],
        name="refused",
        space={"data.prepared": {"choice": [str(missing)]}},
        scheduler="fifo",
    )
    with pytest.raises(UserError) as raised:
        raytrain_lm.sweep(path)
    assert type(raised.value) is UserError  # not Ray's error class deriving from it
    assert str(raised.value) == f"no manifest.json in {missing}: not a prepared dataset"
    uri = next(o.split("=", 1)[1] for o in tiny_overrides if o.startswith("tracking.uri="))
    _, children, parent = _children(uri, tmp_path / "runs" / "refused")
    assert parent.info.status == "FAILED"
    assert not [r for r in children if r.info.status == "RUNNING"]


def test_a_pbt_sweep_keeps_everything_in_a_bucket(
    ray_session, s3, shared_dirs, tmp_path, monkeypatch
):
    """PBT, 2 trials perturbed together every 2 steps: the weaker trial continues from the
    stronger one's checkpoint with a mutated learning rate, and each trial is one MLflow run
    with the whole step history. With output_dir and data.cache_dir in a bucket (a real
    S3-protocol server): the sweep's record, Tune's state, the trials' run directories,
    checkpoints and starts, and the report are objects there; the checkpoint is copied bucket
    to bucket; `sweep report` reads the sweep back from the bucket; and no local runs/ or data/
    folder appears. The trials are sharded (hsdp; on one node one shard group of 2): each rank
    uploads its own shards into the bucket, and the adopted checkpoint is such a set. (Local
    sweeps: the ASHA test; adoption shares its code with them.)"""
    bucket = s3.new_bucket("sweeps")
    monkeypatch.chdir(tmp_path)  # the default local folders would appear here
    path = write_sweep(
        tmp_path,
        [
            *TINY,
            f"output_dir={bucket}/runs",
            f"data.cache_dir={bucket}/data",
            f"tracking.uri=sqlite:///{shared_dirs['mlflow']}",
            "training.max_steps=4",
            "parallel.strategy=hsdp",
        ],
        name="cloud-pbt",
        num_samples=2,
        seed=0,
        space={"model.n_embd": {"choice": [32, 48]}},
        scheduler={
            "kind": "pbt",
            "perturbation_interval": 2,
            "synch": True,
            "quantile_fraction": 0.5,
            "hyperparam_mutations": {"optim.lr": {"loguniform": [1e-3, 1e-2]}},
        },
    )
    summary = raytrain_lm.sweep(path)
    sweep_dir = f"{bucket}/runs/cloud-pbt"
    assert summary["trials"] == 2 and summary["errored"] == 0 and not summary["interrupted"]
    assert summary["directory"] == sweep_dir and summary["report"] == f"{sweep_dir}/report.png"

    keys = s3.keys(sweep_dir)
    assert {"sweep.json", "report.png"} <= set(keys), keys
    (record,) = audit.read(bucket)  # the audit log beside the runs, in the bucket too
    assert record["action"] == "sweep" and record["run"] == "cloud-pbt" and record["config_digest"]
    assert any(k.startswith("tune/") for k in keys), keys  # Tune's storage_path
    assert any(k.startswith("data/") and k.endswith("/manifest.json") for k in s3.keys(bucket))
    client, children, parent = _children(f"sqlite:///{shared_dirs['mlflow']}", sweep_dir)
    assert parent.info.status == "FINISHED"
    assert len(children) == 2 and len({r.data.tags[TAG_TRIAL] for r in children}) == 2
    names = {r.info.run_name for r in children}
    all_runs = client.search_runs([parent.info.experiment_id], max_results=1000)
    assert sorted(r.info.run_name for r in all_runs if r.info.run_name in names) == sorted(names)
    copied = 0
    for run in children:
        name = run.info.run_name
        assert run.info.status == "FINISHED", run.info
        assert _steps(client, run.info.run_id) == [1, 2, 3, 4]
        assert _starts(sweep_dir, name) >= 1
        assert any(k.startswith(f"starts/{name}/") for k in keys)
        assert f"{TRIALS_DIR}/{name}/config.yaml" in keys
        complete = [k for k in keys if k.startswith(f"{TRIALS_DIR}/{name}/checkpoint_")]
        assert any(k.endswith("/COMPLETE") for k in complete), keys
        assert any(k.endswith("/__0_0.distcp") for k in complete), keys  # sharded
        run_dir = f"{sweep_dir}/{TRIALS_DIR}/{name}"
        saved = yaml.safe_load(RunDir(run_dir).read_text("config.yaml"))
        lr = json.loads(run.data.tags[TAG_PBT_VALUES])["optim.lr"]
        assert 1e-3 <= lr <= 1e-2 and saved["optim"]["lr"] == lr  # trained with its value
        donor = run.data.tags.get(TAG_PBT_DONOR)
        if donor:
            copied += 1
            donor_name, step = donor.rsplit("@", 1)
            assert donor_name in names - {name} and int(step) in (2, 4)
            restored = [e["restored_step"] for e in read_events(run_dir) if "restored_step" in e]
            assert int(step) == 4 or int(step) in restored, restored
    assert copied >= 1  # a checkpoint copied from one trial's run directory to the other's

    code = cli.run(["sweep", "report", "cloud-pbt", "--output-dir", f"{bucket}/runs"])
    assert code == 0
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()
