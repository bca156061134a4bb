"""A sweep's MLflow runs: one parent run for the sweep, one nested child run per trial.

We create and reuse them ourselves (the parent's run id lives in `sweep.json`, each child's
in its trial's run directory), so a restored sweep continues the same runs instead of
opening duplicates. Every child run gets its end state (and its loss curve) as soon as Tune
knows it (`CloseTrialRuns`), and none stays RUNNING once the driver stops
(`settle_children`).
"""

from __future__ import annotations

import json
from os.path import join
from typing import Any

from ray.tune import Callback

from raytrain_lm.checkpoints import MODEL_FILE, latest_complete_checkpoint, read_state
from raytrain_lm.config import flatten
from raytrain_lm.rundir import TOKENIZER_FILE, RunDir
from raytrain_lm.sweeps.plots import log_loss_curve
from raytrain_lm.sweeps.spec import Sweep
from raytrain_lm.tracking.access import check_can_log
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker

TAG_SWEEP = "raytrain_lm.sweep"
TAG_TRIAL = "raytrain_lm.trial_id"
TAG_STOPPED_EARLY = "raytrain_lm.stopped_early"
TAG_PBT_DONOR = "raytrain_lm.pbt.donor"
TAG_PBT_VALUES = "raytrain_lm.pbt.values"


def open_parent_run(sweep: Sweep, record: dict[str, Any], git_commit: str | None):
    """Starts the sweep's parent run, or reopens the one `record` names; logs the space,
    the sampler and the base config as params."""
    # Before the sweep starts anything: a login the store refuses, or read-only rights
    # (a trial's `train` asks again for its own run).
    check_can_log(record["tracking_uri"], sweep.base["tracking"]["experiment"])
    parent = MLflowTracker.start(
        record["tracking_uri"],
        sweep.base["tracking"]["experiment"],
        sweep.name,
        record.get("parent_run_id"),
        tags={
            TAG_SWEEP: sweep.name,
            "raytrain_lm.kind": "sweep",
            "mlflow.source.git.commit": git_commit,
        },
        wait_s=sweep.base["tracking"]["start_wait_s"],
    )
    parent.log_params(
        {
            **{f"space.{k}": json.dumps(v) for k, v in sweep.spec.space.items()},
            "num_samples": sweep.spec.num_samples,
            "search": sweep.spec.search,
            "scheduler": sweep.spec.scheduler.kind,
            **{f"base.{k}": v for k, v in flatten(sweep.base).items()},
        }
    )
    return parent


class TrialRuns:
    """The sweep's MLflow parent run and its children, as the driver sees them."""

    def __init__(self, uri: str, parent_run_id: str, trials_dir: str | None = None):
        self.uri, self.parent_run_id = uri, parent_run_id
        self.trials_dir = trials_dir  # where the trials' run directories are (None: unknown)

    @property
    def client(self):
        # Built on use: Tune pickles its callbacks (and so this object) with its state.
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def children(self) -> list:
        parent = self.client.get_run(self.parent_run_id)
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [parent.info.experiment_id],
                f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'",
                max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def child(self, trial_id: str):
        return next((r for r in self.children() if r.data.tags.get(TAG_TRIAL) == trial_id), None)

    def close(self, run, status: str, stopped_early: bool = False) -> None:
        """Ends a child run the trial itself could not end (stopped by the scheduler, or the
        sweep interrupted), with its loss curve. `stopped_early` is Tune's word, which comes
        after the report that made the scheduler stop the trial: a trial that trained to its
        last step meanwhile is not marked so."""
        if stopped_before_its_end(self.client, run):
            if stopped_early:
                self.client.set_tag(run.info.run_id, TAG_STOPPED_EARLY, "true")
        elif status == "FINISHED":
            self.publish_final_model(run)
        log_loss_curve(self.client, run.info.run_id)
        self.client.set_terminated(run.info.run_id, status=status)

    def publish_final_model(self, run) -> None:
        """Logs the final weights and tokenizer of a trial that trained to its last step but
        whose own publication never ran: Tune stopped it on its last report, which came
        before. Every trial that is not marked stopped early then has its final model."""
        run_id = run.info.run_id
        if self.trials_dir is None:
            return
        published = {a.path for a in self.client.list_artifacts(run_id, "final")}
        if {f"final/{MODEL_FILE}", f"final/{TOKENIZER_FILE}"} <= published:
            return
        final = latest_complete_checkpoint(RunDir(join(self.trials_dir, run.info.run_name)))
        _, planned = steps_trained(self.client, run)
        if final is None or planned is None or read_state(final).step < planned:
            return
        with RunDir(final).local_files(MODEL_FILE, TOKENIZER_FILE) as (weights, tokenizer):
            self.client.log_artifact(run_id, str(weights), "final")
            self.client.log_artifact(run_id, str(tokenizer), "final")


def steps_trained(client, run) -> tuple[int, int | None]:
    """The last step whose train loss a trial's run logged (0: none), and the step the trial
    was to train to (None: its params do not say)."""
    params = run.data.params
    try:
        planned = int(params["training.max_steps"])
    except (KeyError, ValueError):
        return 0, None
    stop_after = params.get("training.stop_after_step", "None")
    if stop_after not in ("None", ""):
        planned = min(planned, int(stop_after))
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    return max((m.step for m in losses), default=0), planned


def short_of_its_end(trained: int, planned: int | None) -> bool:
    """Whether `steps_trained`'s figures say the run stopped before its last step (unknown
    counts as stopped)."""
    return planned is None or trained < planned


def stopped_before_its_end(client, run) -> bool:
    return short_of_its_end(*steps_trained(client, run))


class CloseTrialRuns(Callback):
    """Gives every trial's MLflow run its end state as soon as Tune knows it."""

    def __init__(self, runs: TrialRuns):
        self.runs = runs

    def on_trial_complete(self, iteration, trials, trial, **info):
        # run_trial's last report says it trained to the end; without it, the scheduler
        # stopped the trial. A trial ended that way leaves its run's status to us (launch.py);
        # a FAILED one here was written by an older version, whose trials marked it so.
        stopped_early = not (trial.last_result or {}).get("done_steps")
        self._settle(trial.trial_id, "FINISHED", stopped_early=stopped_early)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._settle(trial.trial_id, "FAILED")

    def _settle(self, trial_id: str, status: str, stopped_early: bool = False) -> None:
        try:
            run = self.runs.child(trial_id)
            if run is None:
                return
            if run.info.status == "RUNNING" or (stopped_early and run.info.status == "FAILED"):
                self.runs.close(run, status, stopped_early)
            elif run.info.status == "FINISHED":
                log_loss_curve(self.runs.client, run.info.run_id)
        except Exception as exc:  # the store may be down: the end-of-sweep pass retries
            print(f"[raytrain-lm] warning: could not update trial {trial_id}'s MLflow run: {exc}")


def settle_children(runs: TrialRuns, completed: dict[str, bool], errored: set[str]) -> None:
    """No child run stays RUNNING once the driver stops: finished (`completed` maps a trial
    to whether the scheduler stopped it early), failed, or otherwise KILLED until a restore
    reopens it. An early-stopped trial's run marked FAILED (older versions did so as the
    scheduler ended it) is FINISHED."""
    try:
        children = runs.children()
    except Exception as exc:
        print(f"[raytrain-lm] warning: could not list the sweep's MLflow runs: {exc}")
        return
    for run in children:
        trial_id = run.data.tags.get(TAG_TRIAL)
        early = completed.get(trial_id, False)
        if run.info.status != "RUNNING" and not (early and run.info.status == "FAILED"):
            continue
        try:
            if trial_id in errored:
                runs.close(run, "FAILED")
            elif trial_id in completed:
                runs.close(run, "FINISHED", stopped_early=early)
            else:
                runs.client.set_terminated(run.info.run_id, status="KILLED")
        except Exception as exc:
            print(f"[raytrain-lm] warning: could not end MLflow run {run.info.run_id}: {exc}")
