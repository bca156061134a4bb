"""The driver side of a training run: check and prepare, open tracking, run the TorchTrainer
until the run is done (restarting at once after a spot notice, ending cleanly on a stop
request), then publish the summary, final weights and tracking record."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from raytrain_lm import audit
from raytrain_lm.checkpoints import (
    check_strategy_resumes,
    ever_checkpointed,
    latest_complete_checkpoint,
    read_state,
)
from raytrain_lm.config import RunConfig, flatten, read_written_config, to_yaml
from raytrain_lm.data.checks import check_data_matches_model, check_inputs
from raytrain_lm.data.manifest import mlflow_dataset, verify_shards
from raytrain_lm.data.prepare import prepare
from raytrain_lm.errors import UserError
from raytrain_lm.huggingface import apply_init_from
from raytrain_lm.placement import pin_ray_data_actors_here, withdrawn_at_exit
from raytrain_lm.run_events.journal import append_event, read_events
from raytrain_lm.rundir import (
    CONFIG_FILE,
    SUMMARY_FILE,
    TOKENIZER_FILE,
    TRACKING_FILE,
    RunDir,
    is_uri,
)
from raytrain_lm.runlease import RunLease
from raytrain_lm.runtime import ensure_ray
from raytrain_lm.storage import check_writable
from raytrain_lm.tokenization import load_tokenizer
from raytrain_lm.tracking.access import check_can_log
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.batch_plan import end_step
from raytrain_lm.trainer.components.budget import refuse_if_spent
from raytrain_lm.trainer.components.spot_first import CAPACITY
from raytrain_lm.trainer.driver.capacity import create_capacity_view, refresh_capacity_view
from raytrain_lm.trainer.driver.fit import fit
from raytrain_lm.trainer.driver.publish import finished_summary, publish, read_summary
from raytrain_lm.trainer.driver.stopping import GracefulStop
from raytrain_lm.trainer.spec import TrackingTarget, WorkerSpec
from raytrain_lm.trainer.storage_checks import check_nodes_see

# What defines a run: resuming with any of these changed would silently make a different run.
IDENTITY_SECTIONS = ("model", "data", "optim")
IDENTITY_KEYS = ("training.global_batch_size", "training.seed")


def train(
    cfg: RunConfig,
    *,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
    callbacks: list | None = None,
    may_change: tuple[str, ...] = (),
    reports: Any = None,
    lease: RunLease | None = None,
) -> dict[str, Any]:
    """Runs (or resumes) `cfg` to completion and returns the summary dict.

    A sweep trial passes its sweep's MLflow `parent_run_id`, `tags` for its MLflow run, extra
    Ray Train `callbacks` (its report to Tune; replica groups put theirs in the `reports`
    queue themselves), under PBT the keys it `may_change` when it resumes (a perturbation),
    and the `lease` on the run it holds already. A run stopped on request (`raytrain-lm
    stop`, SIGTERM, Ctrl-C) returns its summary at the stop's checkpoint with `stopped:
    true`; one that spent `budget.max_usd`, with `stopped: "budget"`. A run that had trained
    to its end returns its summary as it finished, changing nothing.

    One process writes a run: its lease (runlease.py) is taken before anything of the run is
    written and held until it ends; while it is held, another run of the name is refused.
    """
    started = time.time()
    # Workers, trials and job drivers run in working directories of their own: every path
    # and the tracking store are pinned here, where the user's working directory is known.
    cfg = cfg.resolved()
    run_dir = RunDir.of(cfg.output_dir, cfg.name)
    _check_writable(cfg.output_dir)
    if lease is not None and lease.run_dir != run_dir:
        raise ValueError(f"a lease on {lease.run_dir} cannot cover the run in {run_dir}")
    owned = lease is None  # else the caller (a sweep trial) took it and releases it
    with RunLease(run_dir, cfg.name) if owned else contextlib.nullcontext(lease) as held:
        held.on_lost = lambda: stop_requests.request_stop(run_dir, why="lease_lost")
        cfg = apply_init_from(cfg)
        _check_resume_compatible(cfg, run_dir, may_change)
        previous = latest_complete_checkpoint(run_dir)
        state = read_state(previous) if previous is not None else None
        finished = _finished_already(cfg, run_dir, previous, state)
        if finished is not None:
            return finished
        check_inputs(cfg.data)  # what can be refused without Ray, before starting it
        if cfg.tracking.enabled:
            check_can_log(cfg.tracking.uri, cfg.tracking.experiment)
        if not cfg.data.prepared:
            _connect(cfg)  # sized for training, before prepare's Ray Data job starts a Ray
        data_dir = _prepared_data(cfg)
        _connect(cfg)
        check_nodes_see(cfg, data_dir)

        checkpointed = ever_checkpointed(run_dir)
        if checkpointed and previous is None:
            raise UserError(
                f"run '{cfg.name}' has checkpoints in {run_dir} but none is complete; refusing "
                "to start from step 0 (remove the run directory to start afresh)"
            )
        earlier = read_summary(run_dir) if state is not None else None
        if state is not None:
            check_strategy_resumes(cfg.name, cfg.parallel.strategy, state.strategy)
            refuse_if_spent(cfg.budget, cfg.name, run_dir)
            print(f"[raytrain-lm] resuming run '{cfg.name}' from {previous.name}: step "
                  f"{state.step}, {state.tokens:,} tokens", flush=True)  # fmt: skip
        # Who submitted it, written first (audit.py); nothing of the run is written before
        # the tracking store answered: a run refused here leaves no trace in its folder.
        tags = {**(tags or {}), **audit.job_record(cfg.output_dir)}
        tracker = _open_tracking(cfg, run_dir, parent_run_id, tags)
        _record_start(cfg, run_dir, data_dir, tracker)

        spec = WorkerSpec(
            config=cfg,
            data_dir=data_dir,
            run_dir=run_dir,
            tracking=TrackingTarget(tracker.uri, tracker.run_id) if tracker else None,
            expect_checkpoint=checkpointed,
            read_cpus=cfg.scaling.data_cpus / cfg.scaling.max_size,
            checkpoint_strategy=state.strategy if state is not None else None,
            fault=chaos.from_environment(),
            reports=reports,
        )
        stopped = False
        trains = state is None or state.step < end_step(cfg.training)
        if not trains:  # trained to the end by a driver that did not publish it (or stopped)
            print(f"[raytrain-lm] run '{cfg.name}' already trained to step {state.step}")
        else:
            stopped = _train_tracked(spec, callbacks, tracker, in_sweep=parent_run_id is not None)
        held.check()  # a driver that lost its lease publishes nothing
        return publish(spec, tracker, started, stopped, trains, earlier)


def _finished_already(cfg: RunConfig, run_dir: RunDir, previous, state) -> dict[str, Any] | None:
    """The summary of a run that trained to its end and was published: starting it again
    changes nothing."""
    if state is None or state.step < end_step(cfg.training):
        return None
    finished = finished_summary(run_dir, previous)
    if finished is not None:
        print(f"[raytrain-lm] run '{cfg.name}' already trained to step {state.step}: "
              f"nothing to do (its summary: {run_dir.at(SUMMARY_FILE)})", flush=True)  # fmt: skip
    return finished


def _record_start(cfg: RunConfig, run_dir: RunDir, data_dir: str, tracker) -> None:
    """The run directory's config, and the tracked run's record, params, dataset and files."""
    run_dir.create()
    run_dir.write_text(to_yaml(cfg), CONFIG_FILE)
    if tracker is None:
        return
    record = {"tracking_uri": tracker.uri, "mlflow_run_id": tracker.run_id}
    run_dir.write_text(json.dumps(record), TRACKING_FILE)
    tracker.log_params(flatten(cfg))
    tracker.log_dataset(mlflow_dataset(data_dir, None if cfg.data.prepared else cfg.data.sources))
    run_dir.write_text(load_tokenizer(data_dir).to_json(), TOKENIZER_FILE)
    with run_dir.local_files(CONFIG_FILE, TOKENIZER_FILE) as (config, tokenizer):
        tracker.log_artifact(config)
        tracker.log_artifact(tokenizer)


def _train_tracked(spec: WorkerSpec, callbacks: list | None, tracker, in_sweep: bool) -> bool:
    """Trains until done; a run that fails or is interrupted is ended so in MLflow."""
    try:
        return _train_until_done(spec, callbacks)
    except BaseException:
        if tracker is not None:
            # A sweep's trial ends this way when its scheduler stops it too: its driver,
            # which knows why, ends the run (a later FAILED would overwrite it).
            ended = "KILLED" if _interrupted() else "FAILED"
            tracker.finish(None if in_sweep else ended)
        raise


def _connect(cfg: RunConfig) -> None:
    """Ray for this run, with the cluster-wide actors Ray Data and Ray Train would otherwise
    create on their own terms made first (idempotent)."""
    ensure_ray(cfg.scaling)
    pin_ray_data_actors_here()
    create_capacity_view()


def _prepared_data(cfg: RunConfig) -> str:
    """Prepares (or finds) the run's dataset and refuses data the model cannot use."""
    prepared = prepare(cfg.data)
    manifest = prepared.manifest
    # Refuse corrupted data before starting. Shards the verification stamp vouches for are not
    # hashed again; after a fresh prepare this hashes each once, so workers need not.
    verify_shards(prepared.directory, manifest)
    verb = "prepared" if prepared.created else "using prepared"
    print(
        f"[raytrain-lm] {verb} data {prepared.directory}: {manifest.splits['train'].tokens:,} train "
        f"/ {manifest.splits['val'].tokens:,} val tokens, {manifest.tokenizer_kind} tokenizer "
        f"(vocab {manifest.vocab_size})",
        flush=True,
    )
    check_data_matches_model(cfg.data, cfg.model, manifest)
    directory = prepared.directory
    return directory if is_uri(directory) else os.path.abspath(directory)


def _train_until_done(spec: WorkerSpec, callbacks: list | None) -> bool | str:
    """Runs worker groups until the run reaches its end step or is stopped on request (then
    returns True). A group that ended itself for a spot notice is followed by a new one at
    once, on the nodes that stay; failures are Ray Train's to retry, within the budgets."""
    cfg, run_dir = spec.config, spec.run_dir
    append_event(run_dir, "job_start", pid=os.getpid())
    handoffs = 0
    controller_failed_at: int | None = None  # the newest checkpoint's step at the last one
    # spot_first: an on-demand request the chief made is the run's only while it trains
    with GracefulStop(run_dir, cfg.fault.stop_timeout_s) as stopping, withdrawn_at_exit(cfg.name):
        while True:
            try:
                fit(spec, callbacks)
            except Exception as exc:
                controller_failed_at = _start_again_after(exc, spec, controller_failed_at)
                spec = replace(spec, expect_checkpoint=True)
                continue
            events = read_events(run_dir)
            reason = stop_requests.handoff_reason(events)
            why = stop_requests.stop_why(events) if reason == stop_requests.STOP else None
            if why == "capacity":  # scaling.capacity=spot_first: onto other nodes (spot_first.py)
                if stopping.requested or stop_requests.stop_requested(run_dir):
                    return True  # a stop came while the group checkpointed for the switch
                market = stop_requests.last_stop(events)["market"]
                append_event(
                    run_dir, CAPACITY, market=market, step=stop_requests.last_stop(events)["step"]
                )
                refresh_capacity_view()
                spec = replace(spec, expect_checkpoint=True)
                print(
                    f"[raytrain-lm] restarting on {market.replace('_', '-')} capacity", flush=True
                )
                continue
            if reason == stop_requests.STOP:  # on request (True), or with budget.max_usd spent
                return "budget" if why == "budget" else True
            if reason == stop_requests.REPLICAS_TOO_FEW:
                gave_up = [e for e in read_events(run_dir) if e["event"] == reason][-1]
                raise UserError(
                    f"{gave_up['reason']}; run '{cfg.name}' stopped at step {gave_up['step']}: "
                    "start it again to resume once capacity is back, or lower scaling.min_workers"
                )
            reached = latest_complete_checkpoint(run_dir)
            if (
                reason not in (stop_requests.PREEMPTION, stop_requests.LIGHTHOUSE_LOST)
                or reached is None
            ):
                return False
            if read_state(reached).step >= end_step(cfg.training):
                return False
            handoffs += 1
            budget = cfg.fault.max_preemptions
            if budget != -1 and handoffs > budget:
                raise RuntimeError(
                    f"run '{cfg.name}' was preempted {handoffs} times, over "
                    f"fault.max_preemptions={budget}; start it again to resume"
                )
            # The drained node counts for nothing now (capacity.py): the new group is sized
            # for the nodes that stay instead of waiting for one it cannot place.
            refresh_capacity_view()
            spec = replace(spec, expect_checkpoint=True)
            print(
                f"[raytrain-lm] restarting after {reason.replace('_', ' ')} at step "
                f"{read_state(reached).step}",
                flush=True,
            )


def _start_again_after(exc: Exception, spec: WorkerSpec, failed_at: int | None) -> int:
    """After Ray Train's controller itself failed (not the training: a worker group that could
    not be replaced in time when every replica group was lost at once, on a loaded machine),
    the run starts again from its newest checkpoint, as a restart does; re-raises anything
    else, and a second such failure with no checkpoint written since. Returns that step."""
    from ray.train.v2.api.exceptions import ControllerError

    cfg, run_dir = spec.config, spec.run_dir
    reached = latest_complete_checkpoint(run_dir)
    if not isinstance(exc, ControllerError) or reached is None:
        raise exc
    step = read_state(reached).step
    if step >= end_step(cfg.training) or (failed_at is not None and step <= failed_at):
        raise exc
    append_event(run_dir, "controller_failed", step=step, error=str(exc).splitlines()[0][:200])
    print(
        f"[raytrain-lm] Ray Train's controller failed ({type(exc.controller_failure).__name__}); "
        f"restarting from the checkpoint at step {step}",
        flush=True,
    )
    return step


def _interrupted() -> bool:
    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


# ----------------------------------------------------------------------------- checks


def _check_writable(output_dir: str) -> None:
    """Fails early if `output_dir` could not be created or written, leaving nothing behind."""
    if is_uri(output_dir):
        check_writable(output_dir, "output_dir")
        return
    directory = Path(output_dir)
    existing = directory
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"output directory {directory} is not writable: {exc.strerror}") from None


def _check_resume_compatible(
    cfg: RunConfig, run_dir: RunDir, may_change: tuple[str, ...] = ()
) -> None:
    """`may_change`: keys a PBT trial may resume with changed (see sweeps.PBT_MUTABLE)."""
    saved_text = run_dir.read_text(CONFIG_FILE)
    if saved_text is None:
        return
    saved_tree = yaml.safe_load(saved_text)
    with contextlib.suppress(ValueError):
        # Runs saved before paths were resolved on the driver name them relatively.
        saved_tree = yaml.safe_load(to_yaml(read_written_config(saved_tree).resolved()))
    saved = flatten(saved_tree)
    current = flatten(yaml.safe_load(to_yaml(cfg)))  # secrets hidden, as in the saved file
    for key, value in current.items():
        if key in may_change:
            continue
        if key.split(".")[0] in IDENTITY_SECTIONS or key in IDENTITY_KEYS:
            old = saved.get(key)
            if old != value:
                raise UserError(
                    f"run '{cfg.name}' exists with {key}={old!r}, now {value!r}; "
                    f"resume with the same settings or choose another name=..."
                )


# ----------------------------------------------------------------------------- tracking


def _open_tracking(
    cfg: RunConfig,
    run_dir: RunDir,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
) -> MLflowTracker | None:
    """The run's MLflow run: the one its tracking record names when resuming, else a new one,
    nested under `parent_run_id` (a sweep) when given, tagged with `tags`."""
    if not cfg.tracking.enabled:
        return None
    uri = cfg.tracking.uri
    record = run_dir.read_text(TRACKING_FILE)
    run_id = json.loads(record)["mlflow_run_id"] if record is not None else None
    return MLflowTracker.start(
        uri,
        cfg.tracking.experiment,
        cfg.name,
        run_id,
        parent_run_id=parent_run_id,
        tags=tags,
        wait_s=cfg.tracking.start_wait_s,
    )


def default_ray_env() -> None:
    """Quiet, fast defaults for local runs; users can override any of them in the environment."""
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # torchft's Lighthouse and managers (replica groups) log every quorum and vote at INFO.
    os.environ.setdefault("RUST_LOG", "warn")
