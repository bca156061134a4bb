"""The pieces of fault tolerance that need no cluster: checkpoint completeness and pruning,
goodput accounting, elastic config checks, fault injection parsing, the watchdog."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raytrain_lm.checkpoints import (
    TrainState,
    best_checkpoint,
    is_complete,
    latest_complete_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from raytrain_lm.config import load_config
from raytrain_lm.errors import UserError
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import (
    Heartbeat,
    append_event,
    close_previous_segment,
    read_events,
)
from raytrain_lm.rundir import RunDir
from raytrain_lm.runtime import check_schedulable
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.components.batch_plan import BatchPlan

pytestmark = pytest.mark.no_ray


def _save(run_dir: Path, step: int, val_loss: float | None = None) -> Path:
    model = GPT(GPTShape(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=8))
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(step=step, val_loss=val_loss, val_step=step if val_loss else None)
    directory = run_dir / f"checkpoint_{step:04d}"
    save_checkpoint(directory, model, optimizer, state, {"config.yaml": "name: t\n"})
    return directory


def test_checkpoint_is_complete_only_with_every_listed_file(tmp_path):
    directory = _save(tmp_path, 1)
    assert is_complete(directory)
    listed = json.loads((directory / "COMPLETE").read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "train_state.json"} <= set(listed)
    with open(directory / "optimizer.pt", "r+b") as f:  # an upload cut short
        f.truncate(10)
    assert not is_complete(directory)
    other = _save(tmp_path, 2)
    (other / "model.safetensors").unlink()
    assert not is_complete(other)
    assert latest_complete_checkpoint(tmp_path) is None


def test_prune_keeps_last_k_and_the_best(tmp_path):
    for step, val in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, None)):
        _save(tmp_path, step, val)
    (tmp_path / "checkpoint_9999").mkdir()  # incomplete: maybe an upload in progress
    assert best_checkpoint(tmp_path).name == "checkpoint_0002"
    removed = prune_checkpoints(tmp_path, keep_last=2, keep_best=True)
    assert sorted(p.name for p in removed) == ["checkpoint_0001", "checkpoint_0003"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint_0002", "checkpoint_0004", "checkpoint_0005", "checkpoint_9999"]
    prune_checkpoints(tmp_path, keep_last=1, keep_best=False)
    assert latest_complete_checkpoint(tmp_path).name == "checkpoint_0005"
    assert not (tmp_path / "checkpoint_0002").exists()


def test_goodput_from_events(tmp_path):
    run = tmp_path
    append_event(run, "job_start", t=0.0)
    append_event(
        run, "segment_start", t=11.0, segment="a", t_start=10.0, restored_step=0,
        world_size=3, price_per_hour=3600.0,
    )  # fmt: skip
    append_event(run, "first_step", t=12.0, segment="a", step=1)
    Heartbeat("a", 50, 60.0, 45.0).write(run)  # 50 steps, the node died after t=60
    append_event(run, "failure_detected", t=63.0)
    close_previous_segment(run)
    close_previous_segment(run)  # idempotent
    append_event(
        run, "segment_start", t=71.0, segment="b", t_start=70.0, restored_step=40,
        world_size=2, price_per_hour=1800.0,
    )  # fmt: skip
    append_event(run, "first_step", t=75.0, segment="b", step=41)
    Heartbeat("b", 100, 130.0, 54.0).write(run)
    close_previous_segment(run)
    events = read_events(run)
    assert sum(e["event"] == "segment_end" for e in events) == 2

    g = summarize(events)
    assert g.restarts == 1 and g.preemptions == 0
    assert g.steps_recomputed == 10  # reached 50, restored 40
    assert g.recovery_s == pytest.approx(75.0 - 60.0)
    assert g.step_s == pytest.approx(99.0)
    assert g.recomputed_s == pytest.approx(45.0 * 10 / 50)
    assert g.wall_s == pytest.approx((60 - 10) + (70 - 60) + (130 - 70))
    assert g.cost == pytest.approx(50 * 1.0 + 60 * 0.5)
    assert g.productive_ratio == pytest.approx((99.0 - 9.0) / 120.0)
    metrics = g.metrics(tokens=2_000_000, tokens_per_step=1024)
    assert metrics["goodput/tokens_recomputed"] == 10 * 1024
    assert metrics["cost/per_million_tokens"] == pytest.approx(80.0 / 2)


def test_goodput_whole_job_restart_counts_from_the_new_job(tmp_path):
    run = tmp_path
    append_event(run, "job_start", t=0.0)
    append_event(
        run, "segment_start", t=1.0, segment="a", t_start=1.0, restored_step=0,
        world_size=1, price_per_hour=0.0,
    )  # fmt: skip
    append_event(run, "first_step", t=2.0, segment="a", step=1)
    Heartbeat("a", 20, 30.0, 25.0).write(run)
    close_previous_segment(run)
    append_event(run, "job_start", t=1000.0)  # the driver was restarted much later
    append_event(
        run, "segment_start", t=1010.0, segment="b", t_start=1005.0, restored_step=20,
        world_size=1, price_per_hour=0.0,
    )  # fmt: skip
    append_event(run, "first_step", t=1012.0, segment="b", step=21)
    g = summarize(read_events(run), now=1020.0)
    assert g.recovery_s == pytest.approx(12.0) and g.steps_recomputed == 0


def test_elastic_config_refuses_a_batch_that_cannot_split():
    with pytest.raises(UserError, match="not divisible by world size 3"):
        load_config(None, ["scaling.min_workers=2", "scaling.max_workers=4"])
    cfg = load_config(
        None, ["scaling.min_workers=2", "scaling.max_workers=4", "training.global_batch_size=24"]
    )
    plans = {w: BatchPlan.derive(cfg.training, w) for w in cfg.scaling.world_sizes}
    assert {w: (p.micro_batch, p.accumulation) for w, p in plans.items()} == {
        2: (12, 1),
        3: (8, 1),
        4: (6, 1),
    }
    assert all(p.global_batch == 24 for p in plans.values())
    with pytest.raises(UserError, match="min_workers .5. exceeds"):
        load_config(None, ["scaling.min_workers=5"])


def test_unschedulable_configs_are_refused_with_the_reason():
    cfg = load_config(None, ["scaling.num_workers=4"])
    with pytest.raises(UserError, match="needs 5 CPUs, the cluster has 4"):
        check_schedulable(cfg.scaling, {"CPU": 4.0})
    check_schedulable(cfg.scaling, {"CPU": 4.0}, fixed_size=False)  # may autoscale
    with pytest.raises(UserError, match="leaves Ray Data no CPU"):
        check_schedulable(load_config(None, ["scaling.data_cpus=0"]).scaling, {"CPU": 8.0})
    slots = load_config(None, ["scaling.worker_resources.slot=1"]).scaling
    with pytest.raises(UserError, match="resource 'slot'"):
        check_schedulable(slots, {"CPU": 8.0, "slot": 1.0})


def test_fault_spec_parsing():
    assert chaos.parse(None) is None
    assert chaos.parse("kill-in-checkpoint:step=8:rank=0") == chaos.Fault(
        "kill-in-checkpoint", step=8, rank=0
    )
    assert chaos.parse("slow-steps:seconds=0.05").seconds == 0.05


def test_slow_steps_pace_until_the_run_directory_says_stop(tmp_path):
    pacer = chaos.Pacer(chaos.parse("slow-steps:seconds=0.2"), RunDir(str(tmp_path)))
    started = time.perf_counter()
    pacer.pace(started)
    assert time.perf_counter() - started >= 0.2
    chaos.stop_pacing(tmp_path)
    pacer._next_check = 0.0  # as a second later
    started = time.perf_counter()
    pacer.pace(started)
    pacer.pace(started)
    assert pacer.seconds == 0.0 and time.perf_counter() - started < 0.2  # paced: 0.2 each
    assert chaos.Pacer(None, RunDir(str(tmp_path))).seconds == 0.0


def test_watchdog_ends_a_stuck_worker():
    code = (
        "import time\n"
        "from raytrain_lm.trainer.components.watchdog import StepWatchdog\n"
        "StepWatchdog(0.5).start()\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 70
    assert "no step finished" in done.stderr and "Stacks follow" in done.stderr


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tmp_path, capfd):
    """Complete means loadable: the newest checkpoint's weights altered in place (same size,
    so the marker's sizes still match) fail the marker's checksum, and restore falls back to
    the checkpoint before; a checkpoint that cannot load at all is skipped the same way."""
    from raytrain_lm.checkpoints import damage, restore_newest

    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    weights = newer / "model.safetensors"
    altered = bytearray(weights.read_bytes())
    altered[-1] ^= 0xFF
    weights.write_bytes(bytes(altered))
    assert is_complete(newer) and "checksum" in damage(newer)
    assert damage(older) is None

    model = GPT(GPTShape(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=8))
    optimizer = torch.optim.AdamW(model.parameters())
    directory, state = restore_newest([older, newer], model, optimizer, torch.device("cpu"))
    assert directory == str(older) and state.step == 1
    assert "cannot restore checkpoint_0002" in capfd.readouterr().out

    # A marker without checksums (as written before they were recorded) and a header that
    # safetensors refuses: loading fails, so it is skipped too.
    marker = json.loads((newer / "COMPLETE").read_text())
    (newer / "COMPLETE").write_text(
        json.dumps({"files": {k: v["size"] for k, v in marker["files"].items()}})
    )
    weights.write_bytes(b"\xff" * len(altered))
    assert is_complete(newer) and damage(newer) is None
    directory, _ = restore_newest([newer, older], model, optimizer, torch.device("cpu"))
    assert directory == str(older)
    assert restore_newest([newer], model, optimizer, torch.device("cpu")) is None


def test_graceful_stop_requests_once_then_forces(tmp_path):
    """The first SIGTERM writes a stop request and lets the run go on; a second ends the
    driver at once; with no second signal, fault.stop_timeout_s ends it."""
    code = (
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from raytrain_lm.rundir import RunDir\n"
        "from raytrain_lm.trainer.driver.stopping import GracefulStop, run_interruptibly\n"
        "run_dir = RunDir(sys.argv[1])\n"
        "def work():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.5)\n"
        "    print('requested', run_dir.exists('STOP'), flush=True)\n"
        "    if sys.argv[2] == 'twice':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "with GracefulStop(run_dir, timeout_s=float(sys.argv[3])):\n"
        "    try:\n"
        "        run_interruptibly(work)\n"
        "    except KeyboardInterrupt:\n"
        "        print('forced', flush=True)\n"
        "print('left', run_dir.exists('STOP'), flush=True)\n"
    )
    for mode, timeout in (("twice", 60.0), ("once", 1.5)):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path), mode, str(timeout)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["requested", "True", "forced", "left", "False"], mode
        assert time.monotonic() - started < 20
        assert "stopping at the next step with a checkpoint" in done.stderr


def test_worker_group_start_timeouts_are_logged_in_one_line(tmp_path):
    """Ray Train's controller logs each worker-group start timeout, and a replica group it
    could not replace on a node that died, with full tracebacks; once our callback is
    unpickled in its process, each is one line that says why. Other errors keep theirs."""
    import io
    import logging
    import pickle

    from ray.train.v2.api.exceptions import WorkerGroupError

    from raytrain_lm.trainer.driver.callbacks import CONTROLLER_LOGGER, FailureEvents

    pickle.loads(pickle.dumps(FailureEvents(str(tmp_path))))
    log, out = logging.getLogger(CONTROLLER_LOGGER), io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    try:
        for error in (_startup_timeout(), _node_died(), WorkerGroupError("boom", {})):
            try:
                raise error
            except Exception as exc:
                log.exception("Error in control loop iteration: %s", exc)
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Error in control loop iteration: ")
    assert "Traceback" not in lines[1]  # the timeout: one line
    assert lines[1] == (
        "Error in control loop iteration: One of the worker actors failed to initialize due "
        "to error: The actor died because its node has died. Node Id: fff1"
    )
    assert sum("Traceback" in line for line in lines) == 1  # the other error: its traceback


def _startup_timeout() -> Exception:
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return WorkerGroupStartupTimeoutError(num_workers=3)


def _node_died() -> Exception:
    """What Ray Train 2.60 raised replacing a replica group in a dead node's slot (seen from
    the CLI, docs/elastic.md), with its nested traceback in the message."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError

    return WorkerGroupStartupFailedError(
        "One of the worker actors failed to initialize due to error:\n"
        "Traceback (most recent call last):\n"
        '  File "worker_group.py", line 494, in _create_workers\n'
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
        "\tclass_name: RayTrainWorker\n"
        "The actor died because its node has died. Node Id: fff1\n"
        "\tthe actor's node was terminated unexpectedly: health check failed"
    )


def test_after_ray_trains_controller_fails_the_run_starts_again_from_a_newer_checkpoint(
    tmp_path,
):
    """Ray Train's controller failing (not the training) ends fit(); the driver starts the run
    again from the newest checkpoint, once per checkpoint written since the last such failure:
    never without one, never for the training's own errors, and not when the run is done."""
    from types import SimpleNamespace

    from ray.train.v2.api.exceptions import ControllerError

    from raytrain_lm.trainer.driver.launch import _start_again_after

    spec = SimpleNamespace(
        config=load_config(None, ["training.max_steps=10"]), run_dir=RunDir.coerce(tmp_path)
    )
    failed = ControllerError(RuntimeError("the worker group could not be replaced"))
    with pytest.raises(ControllerError):
        _start_again_after(failed, spec, None)  # no checkpoint: nothing to start from
    _save(tmp_path, 4)
    assert _start_again_after(failed, spec, None) == 4
    with pytest.raises(ControllerError):
        _start_again_after(failed, spec, 4)  # nothing written since the last one
    with pytest.raises(ValueError):
        _start_again_after(ValueError("the training's own error"), spec, None)
    _save(tmp_path, 7)
    assert _start_again_after(failed, spec, 4) == 7
    _save(tmp_path, 10)
    with pytest.raises(ControllerError):
        _start_again_after(failed, spec, 7)  # the run is done
    restarts = [e for e in read_events(tmp_path) if e["event"] == "controller_failed"]
    assert [e["step"] for e in restarts] == [4, 7]
