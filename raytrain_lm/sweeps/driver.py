"""Running a sweep (`run_sweep`): connect to Ray, open the sweep's MLflow parent run, hand
Tune the trials (or restore an interrupted sweep from `tune/`), then settle every trial's
MLflow run, report, and raise the `UserError` a trial failed with, if any."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray
from ray import tune

from raytrain_lm.config import RunConfig
from raytrain_lm.console import quiet_tune
from raytrain_lm.data.prepare import prepare
from raytrain_lm.errors import UserError, find_user_error
from raytrain_lm.placement import pin_ray_data_actors_here
from raytrain_lm.rundir import RunDir
from raytrain_lm.runtime import ensure_ray, use_gpu
from raytrain_lm.storage import Location, check_writable, is_uri
from raytrain_lm.sweeps.progress import TrialLines
from raytrain_lm.sweeps.record import (
    REPORT_FILE,
    TRIALS_DIR,
    TUNE_DIR,
    save_record,
    sweep_record,
)
from raytrain_lm.sweeps.report import write_report
from raytrain_lm.sweeps.runs import CloseTrialRuns, TrialRuns, open_parent_run, settle_children
from raytrain_lm.sweeps.search import (
    TRIAL_CPU,
    build_scheduler,
    build_search_alg,
    derive_max_concurrent,
    param_space,
)
from raytrain_lm.sweeps.spec import Sweep
from raytrain_lm.sweeps.trial import METRIC, run_trial
from raytrain_lm.trainer import chaos


def connect_ray(sweep: Sweep, base_cfg: RunConfig) -> tuple[bool, int]:
    """Joins or starts Ray for `sweep`, refusing one that can never hold a trial; returns
    whether trials train on GPUs and how many run at once. A local Ray sized for one run
    would leave no room for the trial's own actor: the Train worker would take its CPU and
    Ray Data's readers would wait forever. Ray Data's cluster-lifetime actors are made here,
    on the driver's node: a trial's own driver may run on any node."""
    ensure_ray(base_cfg.scaling, extra_cpus=TRIAL_CPU)
    pin_ray_data_actors_here()
    gpu = use_gpu(base_cfg.scaling)
    fitting = derive_max_concurrent(base_cfg, ray.cluster_resources(), gpu)
    return gpu, sweep.spec.max_concurrent_trials or fitting


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Runs or resumes `sweep`; returns its summary (ranked trials, best first).

    A `UserError` that failed a trial (raised in its actor, its Train workers or a Ray task
    of theirs) is raised here as itself, once every run is settled and the report written.
    """
    from raytrain_lm.trainer.driver.launch import default_ray_env  # torch: only when a sweep runs

    base_cfg = RunConfig.model_validate(sweep.base)
    default_ray_env()
    # Checked before anything is written: a sweep refused here leaves no trace.
    gpu, concurrent = connect_ray(sweep, base_cfg)
    if is_uri(sweep.directory):  # one line naming what is missing, not retries for minutes
        check_writable(base_cfg.output_dir, "output_dir")
    trials_dir = sweep.directory / TRIALS_DIR
    # Trials run in Tune's actors, whose working directory is not ours: pin every path now
    # (and each trial's own values against the same folder: run_trial).
    pinned = base_cfg.resolved()
    if not any(k.startswith("data.") for k in sweep.spec.space) and not pinned.data.prepared:
        # Prepare once here rather than in every trial at the same time.
        pinned.data.prepared = prepare(pinned.data).directory
    base = pinned.model_dump(mode="json")
    record = sweep_record(sweep, pinned.tracking.uri)
    git_commit = _git_commit(Path(__file__).resolve().parent, Path(sweep.source).parent)
    parent = open_parent_run(sweep, record, git_commit)
    record["parent_run_id"] = parent.run_id
    save_record(sweep.directory, record)
    # Only now that the tracking store answered (a Ctrl-C while waiting for it leaves no
    # trace): a local folder, or a prefix in a bucket (which exists once it holds an object).
    RunDir(trials_dir).create()
    parent.log_artifact(sweep.source, "sweep")

    context = {
        "name": sweep.name,
        "base": base,
        "trials_dir": str(trials_dir),
        "working_dir": os.getcwd(),
        "parent_run_id": parent.run_id,
        "git_commit": git_commit,
        "fault": os.environ.get(chaos.ENV_VAR),
        "pbt_mutations": list(sweep.spec.scheduler.hyperparam_mutations)
        if sweep.spec.scheduler.kind == "pbt"
        else [],
    }
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, context=context), {"CPU": TRIAL_CPU}
    )
    runs = TrialRuns(record["tracking_uri"], parent.run_id, str(trials_dir))
    tuner = _tuner(sweep, base_cfg, trainable, runs, concurrent)
    print(
        f"[raytrain-lm] sweep '{sweep.name}': {len(sweep.spec.space)} keys, up to "
        f"{concurrent} trials at a time; MLflow parent run {parent.run_id} at "
        f"{record['tracking_uri']}",
        flush=True,
    )
    grid = _fit(tuner, runs, parent)
    completed, errored, errors = _trial_endings(grid)
    interrupted = len(completed) + errors < len(grid) or len(grid) < sweep.spec.trial_count()
    settle_children(runs, completed, errored)

    png = sweep.directory / REPORT_FILE
    rows = _report_and_finish(
        sweep, record, runs, parent, png, interrupted, all_failed=errors == len(grid)
    )
    user_error = _first_user_error(grid)
    if user_error is not None:
        raise user_error
    return {
        "sweep": sweep.name,
        "directory": str(sweep.directory),
        "mlflow_parent_run_id": parent.run_id,
        "interrupted": interrupted,
        "trials": len(grid),
        "errored": errors,
        "report": str(png),
        "ranked": rows,
    }


def _fit(tuner, runs: TrialRuns, parent):
    """Runs the sweep to its end; if the driver itself is stopped (Ctrl-C, an error), its
    MLflow runs are closed as killed before that goes on up."""
    # Tune installs its own Ctrl-C handler (first press: save state and stop trials) and
    # leaves it in place; a notebook or script that goes on after the sweep gets its own back.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.getsignal(signal.SIGINT) if in_main_thread else None
    try:
        with quiet_tune():
            return tuner.fit()
    except BaseException:
        settle_children(runs, {}, set())
        parent.finish("KILLED")
        raise
    finally:
        if in_main_thread and previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)


def _trial_endings(grid) -> tuple[dict[str, bool], set[str], int]:
    """(completed trial id -> whether the scheduler stopped it early, errored trial ids,
    how many trials errored)."""
    # A trial that trained to the end says so in its last report (`done_steps`); Tune marks
    # the last result of a trial the scheduler stopped `done`. A trial still running or
    # pending when the driver stopped has neither, nor an error. Trial statuses cannot tell:
    # on Ctrl-C Tune saves its state, then stops the running trials, which leaves them
    # TERMINATED in the result grid (RUNNING on disk). Nor can `done` alone: a trial that
    # finished just before an interrupted driver saved its state may be restored without it.
    completed = {
        r.metrics["trial_id"]: not r.metrics.get("done_steps")
        for r in grid
        if r.error is None
        and (r.metrics.get("done") or r.metrics.get("done_steps"))
        and r.metrics.get("trial_id")
    }
    errored = {r.metrics["trial_id"] for r in grid if r.error and r.metrics.get("trial_id")}
    errors = sum(1 for r in grid if r.error)
    return completed, errored, errors


def _report_and_finish(
    sweep: Sweep,
    record: dict[str, Any],
    runs: TrialRuns,
    parent,
    png: Location,
    interrupted: bool,
    all_failed: bool,
) -> list[dict[str, Any]]:
    """Draws the report at `png`, logs it and the best val loss to the parent run, prints
    the table, then finishes the parent run; returns the ranked trials."""
    # MLflow uploads a local file: a sweep in a bucket draws its report here, then copies it
    # there (the copy kept until the parent run is finished, which sends a delayed upload).
    staging = tempfile.mkdtemp(prefix="raytrain-sweep-report-") if is_uri(png) else None
    try:
        drawn = Path(staging, REPORT_FILE) if staging else Path(png)
        rows, table, _ = write_report(record, runs, drawn)
        if staging:
            RunDir(sweep.directory).write_bytes(drawn.read_bytes(), REPORT_FILE)
        parent.log_artifact(drawn)
        best = next((r for r in rows if r["val_loss"] is not None), None)
        if best is not None:
            parent.log_metrics({"best/val_loss": best["val_loss"]}, step=0)
        print(table, flush=True)
        if interrupted:
            print(
                f"[raytrain-lm] sweep '{sweep.name}' interrupted; run the same command again "
                "to resume it",
                file=sys.stderr,
                flush=True,
            )
        parent.finish("KILLED" if interrupted else ("FAILED" if all_failed else "FINISHED"))
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    return rows


def _tuner(sweep: Sweep, base_cfg: RunConfig, trainable, runs: TrialRuns, concurrent: int):
    """A new Tuner for `sweep`, or the one restored from its `tune/` folder."""
    tune_path = sweep.directory / TUNE_DIR
    space = param_space(sweep.spec.space, sweep.spec.scheduler.hyperparam_mutations)
    if tune.Tuner.can_restore(str(tune_path)):  # a local folder or a bucket URI alike
        print(f"[raytrain-lm] resuming sweep '{sweep.name}' from {tune_path}", flush=True)
        # Tune restores the RunConfig it pickled, with its CloseTrialRuns: that one closes the
        # same MLflow runs (the parent run id never changes), so nothing needs replacing, and
        # the end-of-sweep pass reads only the public ResultGrid.
        return tune.Tuner.restore(
            str(tune_path),
            trainable=trainable,
            param_space=space,
            resume_unfinished=True,
            resume_errored=True,
        )
    return tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="min",
            scheduler=build_scheduler(sweep),
            search_alg=build_search_alg(sweep),
            num_samples=sweep.spec.num_samples,
            max_concurrent_trials=concurrent,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=str(sweep.directory),  # a bucket URI: Tune writes there itself
            failure_config=tune.FailureConfig(max_failures=base_cfg.fault.max_failures),
            # Tune's checkpoints are pointers to the trials' own (see trial._report); PBT warns
            # below 3 (a donor's may go before the trials copying it have started).
            checkpoint_config=tune.CheckpointConfig(num_to_keep=4),
            callbacks=[CloseTrialRuns(runs), TrialLines(runs)],
            verbose=0,  # TrialLines says what happens, a line each (console.quiet_tune)
        ),
    )


def _first_user_error(grid) -> UserError | None:
    """The `UserError` that failed a trial (Tune keeps it wrapped in the actor's error)."""
    for result in grid:
        found = find_user_error(result.error) if result.error is not None else None
        if found is not None:
            return found
    return None


def _git_commit(*places: Path) -> str | None:
    """The commit of the first of `places` inside a git checkout: the code that trains (when
    it runs from a checkout), else the sweep file's project (an installed package)."""
    for where in places:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return None
