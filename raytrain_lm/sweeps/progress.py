"""What a sweep prints while it runs, from its driver, in place of Tune's tables (Tune runs
with verbose=0: console.quiet_tune): a line when a trial starts, with its values, and one when
it ends (finished, stopped early by the scheduler, failed) or is started again after a
failure. How far a trial trained is read from its MLflow run, as the report reads it: Tune's
stop reaches a trial after the report that caused it, and the trial may train on meanwhile."""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from raytrain_lm.sweeps.runs import TrialRuns, steps_trained


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _say(text: str) -> None:
    print(f"[raytrain-lm] trial {text}", flush=True)


class TrialLines(Callback):
    """One line per trial event; pickled with Tune's state, so a restored sweep prints alike."""

    def __init__(self, runs: TrialRuns):
        self.runs = runs

    def on_trial_start(self, iteration, trials, trial, **info):
        values = ", ".join(f"{k}={_value(v)}" for k, v in sorted((trial.config or {}).items()))
        _say(f"{trial.trial_id} started: {values}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        step, planned, val_loss = result.get("step"), None, result.get("val_loss")
        try:
            run = self.runs.child(trial.trial_id)
            if run is not None:
                step, planned = steps_trained(self.runs.client, run)
                val_loss = run.data.metrics.get("val/loss", val_loss)
        except Exception:  # the store may be down: Tune's last report says what it can
            pass
        scored = f"val_loss {val_loss:.4f}" if val_loss is not None else "no val_loss yet"
        finished = step >= planned if planned is not None else result.get("done_steps")
        if finished:
            _say(f"{trial.trial_id} finished at step {step}: {scored}")
        else:
            of = f" of {planned}" if planned is not None else ""
            _say(f"{trial.trial_id} stopped early by the scheduler at step {step}{of}: {scored}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        _say(f"{trial.trial_id} failed; starting it again from its last checkpoint")

    def on_trial_error(self, iteration, trials, trial, **info):
        where = trial.error_file or trial.path
        _say(f"{trial.trial_id} failed, fault.max_failures spent (its error: {where})")
