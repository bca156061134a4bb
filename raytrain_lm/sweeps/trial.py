"""What runs in a trial's Tune actor: `run_trial`, one full Ray Train run with the trial's
values, named `<sweep>-<trial id>` in the sweep's `trials/` folder.

The trial is an ordinary training run (its own run directory, checkpoints, elastic scaling,
fault budgets), so a trial restarted for any reason (a preempted node, an errored trial
retried by Tune, a restored sweep) resumes from its own last complete checkpoint. Its Ray
Train reports reach Tune through `ReportToTune` (replica groups' chief puts its own in the
same queue: trainer/checkpointing/chief_uploads.py), each with a Tune checkpoint that only
points at the Train checkpoint; under PBT a trial told to copy another adopts that trial's
checkpoint before it starts (`_adopt`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from ray import tune
from ray.train import UserCallback
from ray.util.queue import Empty, Queue

from raytrain_lm.config import RunConfig, format_validation_error, set_dotted
from raytrain_lm.console import quiet_trial_reports
from raytrain_lm.errors import UserError, surface_user_errors
from raytrain_lm.rundir import RunDir
from raytrain_lm.runlease import TRIAL_PATIENCE_S, RunLease
from raytrain_lm.storage import OUTAGE_RETRY_S, Location, filesystem, is_uri, join, retrying
from raytrain_lm.sweeps.record import record_start
from raytrain_lm.sweeps.runs import TAG_PBT_DONOR, TAG_PBT_VALUES, TAG_SWEEP, TAG_TRIAL
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.chief_uploads import POINTER_FILE

METRIC = "val_loss"  # what Ray Train reports (ray_side.py); ranked low to high
TIME_ATTR = "step"  # survives restarts, unlike Tune's training_iteration


def trial_run_name(sweep_name: str, trial_id: str) -> str:
    return f"{sweep_name}-{trial_id}"


def trial_config(base: dict[str, Any], values: dict[str, Any], run_name: str, trials_dir: str):
    tree = copy.deepcopy(base)
    for key, value in values.items():
        set_dotted(tree, key.split("."), value)
    tree["name"], tree["output_dir"] = run_name, trials_dir
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise UserError(format_validation_error(err, f"trial {run_name}")) from None


class ReportToTune(UserCallback):
    """Runs in the trial's Ray Train controller: hands every report, with the path of the
    checkpoint Ray Train has already persisted, to the trial's actor (`_forward_reports`).

    Ray's `TuneReportCallback` does the same but can only pass metrics; PBT needs a Tune
    checkpoint with each report, to hand to the trials that copy this one."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        item = dict(metrics[0])
        item[POINTER_FILE] = checkpoint_location(checkpoint) if checkpoint is not None else None
        # Blocks until the trial took the previous report: Tune's decisions (stop, pause)
        # come while the trial is at the step that caused them, as with TuneReportCallback.
        self.queue.put(item)


# pyarrow's name of a bucket filesystem -> the scheme of its URIs (RunDir's locations)
_SCHEMES = {"s3": "s3", "gcs": "gs"}


def checkpoint_location(checkpoint) -> str:
    """Where a persisted Ray checkpoint is, as RunDir names it: a local path, or a bucket URI
    (Ray gives a bucket's path without its scheme, next to the filesystem it is in)."""
    scheme = _SCHEMES.get(getattr(checkpoint.filesystem, "type_name", "local"))
    return f"{scheme}://{checkpoint.path.lstrip('/')}" if scheme else checkpoint.path


def _report(metrics: dict[str, Any], train_checkpoint: str | None) -> None:
    """tune.report with a Tune checkpoint that only points at the trial's Ray Train
    checkpoint: the weights stay where they are, once."""
    if train_checkpoint is None:
        tune.report(metrics)
        return
    quiet_trial_reports()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / POINTER_FILE).write_text(json.dumps({"checkpoint": train_checkpoint}))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def _forward_reports(queue, finished: threading.Event, errors: list[Exception]) -> None:
    """The trial actor's side of ReportToTune, in a thread of its own: the trial's function
    thread is busy in Ray Train's fit(). Runs until the Train run has ended and every report
    is passed on."""
    while True:
        try:
            item = queue.get(timeout=0.5)
        except Empty:
            if finished.is_set():
                return
            continue
        if errors:
            continue  # keep taking reports, or the Train controller would block on the queue
        try:
            _report(item, item.pop(POINTER_FILE))
        except Exception as exc:  # raised by run_trial once training is over
            errors.append(exc)


def _same_folder(a: str, b: str) -> bool:
    if is_uri(a) or is_uri(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _adopt(pointer: dict[str, Any], run_dir: str) -> tuple[str, int] | None:
    """PBT's exploit: this trial continues from another trial's checkpoint. Copies it into
    this trial's run directory (a local folder or a bucket URI, like the donor's) as its only
    checkpoint (the trial's own are superseded), the marker last, with the donor's config as
    the run's saved config, so the run resumes from it (fit.fit drops Ray Train's list of
    the removed checkpoints). Returns the donor's run name and step, or None when the
    checkpoint is the trial's own."""
    from raytrain_lm.checkpoints import (  # torch: only where a trial runs
        CONFIG_FILE,
        is_complete,
        latest_complete_checkpoint,
        local_copy,
        read_state,
        upload_checkpoint,
    )

    source = Location(pointer["checkpoint"])
    if _same_folder(source.parent, run_dir):
        return None  # a pause or a restore: the run resumes from its own newest checkpoint
    if not is_complete(source):
        # Pruned meanwhile (the donor trained on past checkpoint.keep_last): its newest.
        newer = latest_complete_checkpoint(source.parent)
        if newer is None:
            raise RuntimeError(f"PBT: no complete checkpoint left in {source.parent} to copy")
        print(f"[raytrain-lm] PBT: {source.name} was pruned; copying {newer.name} instead")
        source = newer
    run = RunDir(str(run_dir))
    run.create()
    for own in run.checkpoint_folders():
        _delete_folder(own)
    with local_copy(source) as local:
        upload_checkpoint(local, run.at(source.name), OUTAGE_RETRY_S)
        run.write_bytes((local / CONFIG_FILE).read_bytes(), CONFIG_FILE)
        step = read_state(local).step
    return source.parent.name, step


def _delete_folder(location: str) -> None:
    fs, inner = filesystem(location)

    def delete() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_dir(inner)

    if is_uri(location):
        retrying(delete, f"deleting {location}")
    else:
        with contextlib.suppress(OSError):  # as shutil.rmtree(ignore_errors=True) did
            delete()


def run_trial(values: dict[str, Any], context: dict[str, Any]) -> None:
    """Tune's trainable: one full Ray Train run with this trial's values, resuming its own
    run directory when it has one (or, under PBT, continuing from the checkpoint of the trial
    it was told to copy).

    The trial holds its run's lease (runlease.py) from before it copies a donor's checkpoint
    in. Tune runs a trial in one actor at a time, but starts it again in a new one after the
    old actor's process died, perhaps on another node: its claim, not renewed, expires within
    TRIAL_PATIENCE_S, which the new one waits out rather than fail the trial."""
    name = trial_run_name(context["name"], tune.get_context().get_trial_id())
    run_dir = RunDir(join(context["trials_dir"], name))
    with RunLease(run_dir, name, patience_s=TRIAL_PATIENCE_S) as lease:
        _run_trial(values, context, lease)


def _run_trial(values: dict[str, Any], context: dict[str, Any], lease: RunLease) -> None:
    # torch and the whole trainer: only where a trial runs
    from raytrain_lm.trainer.driver.launch import default_ray_env
    from raytrain_lm.trainer.driver.launch import train as launch_train

    trial_id = tune.get_context().get_trial_id()
    name = trial_run_name(context["name"], trial_id)
    # A relative path among the trial's values means one in the sweep driver's folder.
    cfg = trial_config(context["base"], values, name, context["trials_dir"])
    cfg = cfg.resolved(context.get("working_dir"))
    mutable = tuple(context.get("pbt_mutations") or ())
    adopted = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            pointer = json.loads((Path(directory) / POINTER_FILE).read_text())
        adopted = _adopt(pointer, join(context["trials_dir"], name))
    default_ray_env()
    if context.get("fault"):
        # Fault injection reaches trials the way it reaches `train`: through the environment
        # of the process that launches the Train run, which here is the trial's actor.
        os.environ[chaos.ENV_VAR] = context["fault"]
    record_start(
        Location(context["trials_dir"]).parent,
        name,
        {"pid": os.getpid(), "job": ray.get_runtime_context().get_job_id()},
    )
    tags = {
        TAG_SWEEP: context["name"],
        TAG_TRIAL: trial_id,
        "mlflow.source.git.commit": context.get("git_commit"),
        "ray.job_id": ray.get_runtime_context().get_job_id(),
        "ray.submission_id": os.environ.get("RAY_JOB_SUBMISSION_ID"),
        "accelerator_type": _accelerator(cfg.scaling.accelerator_type),
        "capacity": cfg.scaling.capacity,
        "spot": str(cfg.scaling.capacity == "spot").lower(),
    }
    if mutable:
        # MLflow params are write-once: the trial's first values stay its params, the values
        # it trains with now are a tag (and train/lr shows the schedule step by step).
        tags[TAG_PBT_VALUES] = json.dumps({k: values[k] for k in mutable})
    if adopted is not None:
        tags[TAG_PBT_DONOR] = f"{adopted[0]}@{adopted[1]}"
        print(f"[raytrain-lm] PBT: continuing from {adopted[0]} at step {adopted[1]}", flush=True)
    queue = Queue(1, actor_options={"num_cpus": 0})
    finished, errors = threading.Event(), []
    forwarder = threading.Thread(
        target=_forward_reports, args=(queue, finished, errors), daemon=True
    )
    forwarder.start()
    try:
        # A UserError from the Train workers fails the trial as itself: the driver raises it
        with surface_user_errors():
            summary = launch_train(
                cfg,
                parent_run_id=context.get("parent_run_id"),
                tags=tags,
                callbacks=[ReportToTune(queue)],
                may_change=mutable,
                reports=queue,
                lease=lease,
            )
    finally:
        finished.set()
    forwarder.join()
    if errors:
        raise errors[0]
    # A trial resumed after it had already trained to the end reports nothing through Train:
    # give Tune its final result either way.
    _report(
        {METRIC: summary["val_loss"], TIME_ATTR: summary["steps"], "done_steps": True},
        summary["checkpoint"],
    )


def _accelerator(kind: str | list[str] | None) -> str:
    if kind is None:
        return "cpu"
    return kind if isinstance(kind, str) else ",".join(kind)
