"""Chaos tests on a local multi-node Ray (raytrain_lm.clusters.multinode.LocalCluster): nodes are killed,
drained and added while runs train; every test checks the data ledger and the final state.

Marked `chaos`: `make test` runs them in their own pytest process after the others, because
they need a multi-node Ray instead of the shared single-node session. A worker killed
while writing a checkpoint needs no other node: tests/test_training.py covers it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import raytrain_lm
from raytrain_lm.checkpoints import complete_checkpoints, read_state
from raytrain_lm.clusters.multinode import Background, LocalCluster, segments, wait_for_event
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.trainer import chaos

pytestmark = pytest.mark.chaos

GLOBAL_BATCH = 12  # divisible by every world size a test uses (1 to 4)


@pytest.fixture(scope="module")
def cluster():
    local = LocalCluster(workers=3)
    yield local
    local.shutdown()


@pytest.fixture
def chaos_overrides(cluster, tiny_overrides):
    # Replace nodes a previous test killed or drained, so each test starts with 3.
    while len(cluster.nodes) < 3:
        cluster.add_node()
    return [
        *tiny_overrides,
        *cluster.overrides(),
        f"training.global_batch_size={GLOBAL_BATCH}",
        "training.ledger=true",
        "training.eval_every=100000",
        "data.shuffle_window_shards=1",
        "scaling.data_cpus=1",
    ]


def _train(overrides: list[str]) -> dict:
    return raytrain_lm.train(load_config(None, overrides), sample=False)


def _assert_exactly_once(run_dir: Path, steps: int) -> None:
    consumed = read_ledger(run_dir)
    assert consumed.tolist() == list(range(steps * GLOBAL_BATCH)), "a sequence repeated or skipped"


def test_node_loss_shrinks_a_sweep_trial_then_it_grows_back(
    cluster, chaos_overrides, tmp_path, monkeypatch
):
    """a. a sweep's trial loses a node: its Ray Train run continues on fewer workers from its
    last checkpoint, inside the same trial; b. the node comes back: the run grows to max
    workers again. The trial completes, every sequence once, and MLflow shows it once, with
    every step. (The elastic notebook does the same with a plain `raytrain_lm.train` run.)"""
    from mlflow.tracking import MlflowClient

    from raytrain_lm.sweeps import TRIALS_DIR, trial_starts

    # >= 90 s of paced steps: long enough to shrink, then grow, mid-run, however slowly a busy
    # machine starts nodes and workers (at 0.1 s a step the notebook's run once ended first);
    # the pacing stops once grown.
    steps = 300
    sweep_file = tmp_path / "spot.yaml"
    sweep_file.write_text(
        "space: {optim.lr: {choice: [0.003]}}\nscheduler: fifo\nmax_concurrent_trials: 1\n"
    )
    overrides = [
        *chaos_overrides,
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        f"training.max_steps={steps}",
        "training.eval_every=25",
        "checkpoint.every_steps=25",
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.3")
    run = Background(lambda: raytrain_lm.sweep(sweep_file, overrides))
    trials = tmp_path / "runs" / "spot" / TRIALS_DIR
    deadline = time.time() + 600
    while not list(trials.glob("*/checkpoint_*/COMPLETE")):
        assert run.running and time.time() < deadline, run.error or "no trial checkpoint"
        time.sleep(0.5)
    (run_dir,) = [p for p in trials.iterdir() if p.is_dir()]
    assert segments(run_dir)[-1]["world_size"] == 3

    killed_at = time.time()
    cluster.kill_node()
    shrunk = wait_for_event(
        run_dir,
        lambda e: e["event"] == "segment_start" and e["world_size"] == 2,
        300,
        after=killed_at,
        still_running=run,
    )
    assert shrunk["restored_step"] >= 25
    cluster.add_node()
    grown = wait_for_event(
        run_dir,
        lambda e: e["event"] == "segment_start" and e["world_size"] == 3,
        300,
        after=shrunk["t"],
        still_running=run,
    )
    assert grown["restored_step"] >= shrunk["restored_step"]
    chaos.stop_pacing(run_dir)  # the rest of the trial at full speed

    summary = run.wait(600)
    assert summary["trials"] == 1 and summary["errored"] == 0 and not summary["interrupted"]
    (row,) = summary["ranked"]
    assert row["status"] == "FINISHED" and row["tokens"] == steps * GLOBAL_BATCH * 32
    starts = trial_starts(trials.parent, run_dir.name)
    assert len(starts) == 1  # Ray Train recovered inside the trial; Tune did not restart it
    _assert_exactly_once(run_dir, steps)
    goodput = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert goodput["restarts"] >= 2 and 0 < goodput["productive_ratio"] < 1
    uri = next(o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri="))
    history = MlflowClient(tracking_uri=uri).get_metric_history(row["run_id"], "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, steps + 1))


def test_drain_writes_a_just_in_time_checkpoint_and_loses_no_step(
    cluster, chaos_overrides, tmp_path, monkeypatch
):
    """c. a spot notice (drain with the preemption reason and a deadline): a just-in-time
    checkpoint is written at once and the next worker group starts from exactly that step, on
    the nodes that stay, while the drained node is still up: with the default worker-start
    timeout (10 minutes), the restart does not ask for a worker it cannot place. The run is a
    llama sharded with hsdp over nodes of one worker each (mesh.py's rule: shard groups of
    the nodes' common worker count, here 1, so 3 replicas, then 2): the just-in-time
    checkpoint is every rank's DCP shards, written by 3 workers and loaded by 2."""
    steps = 250  # the notice comes about 60 steps in; the rest show the smaller group trains on
    run_dir = tmp_path / "runs" / "drain"
    overrides = [
        *chaos_overrides,
        "name=drain",
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        f"training.max_steps={steps}",
        "checkpoint.every_steps=1000",  # the periodic checkpoint would lose many steps
        "fault.worker_start_timeout_s=600",  # the default: a wrongly sized restart waits it out
        "model.arch=llama",
        "parallel.strategy=hsdp",
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.05")
    run = Background(lambda: _train(overrides))
    wait_for_event(run_dir, lambda e: e["event"] == "first_step", 600, still_running=run)
    time.sleep(3)
    drained_at = time.time()
    node = cluster.drain_node(deadline_s=120)  # AWS gives two minutes' notice
    notice = wait_for_event(
        run_dir, lambda e: e["event"] == "preemption", 100, after=drained_at, still_running=run
    )
    # A restart that asked for the draining node's worker too would wait out the whole
    # worker-start timeout (600 s) before starting smaller.
    first_step = wait_for_event(
        run_dir,
        lambda e: e["event"] == "first_step" and e["t"] > notice["t"],
        400,
        still_running=run,
    )
    resumed = segments(run_dir)[-1]
    assert resumed["segment"] == first_step["segment"]
    assert resumed["restored_step"] == notice["step"]  # the just-in-time checkpoint
    assert resumed["world_size"] == 2  # nothing lands on the draining node
    jit = [c for c in complete_checkpoints(run_dir) if read_state(c).step == notice["step"]]
    assert jit and read_state(jit[0]).world_size == 3 and read_state(jit[0]).strategy == "hsdp"
    for segment in segments(run_dir):  # one worker per node: replicas only, never across
        assert segment["layout"] == f"hsdp: mesh {segment['world_size']} (replicate) x 1 (shard)"
    # Well under the start timeout (here it takes ~30 s; a loaded CI machine is slower).
    assert first_step["t"] - notice["t"] < 300, first_step["t"] - notice["t"]
    cluster.kill_node(node)  # the cloud takes the machine at its deadline
    chaos.stop_pacing(run_dir)

    summary = run.wait(600)
    assert summary["steps"] == steps
    assert summary["goodput"]["preemptions"] == 1
    assert summary["goodput"]["steps_recomputed"] == 0  # no optimizer step lost
    _assert_exactly_once(run_dir, steps)


def test_driver_killed_then_same_command_resumes(cluster, chaos_overrides, tmp_path):
    """e. SIGKILL the driver mid-run, start the same command again: it continues from the last
    checkpoint and completes, every sequence once."""
    steps = 200
    run_dir = tmp_path / "runs" / "driver"
    command = [
        sys.executable,
        "-m",
        "raytrain_lm.cli",
        "train",
        *[
            f"--set={o}"
            for o in [
                *chaos_overrides,
                "name=driver",
                "scaling.num_workers=2",
                f"training.max_steps={steps}",
                "checkpoint.every_steps=20",
                f"scaling.ray_address={cluster.address}",
            ]
        ],
    ]
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while not complete_checkpoints(run_dir) and time.time() < deadline:
            assert first.poll() is None, first.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        assert complete_checkpoints(run_dir), "no checkpoint written"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming run 'driver' from checkpoint_" in second.stdout
    _assert_exactly_once(run_dir, steps)
