"""What `sweep report` and a sweep's MLflow runs say of each trial, read from the runs
themselves (a real MLflow store, no sweep run): a trial is stopped early only if it stopped
before its last step. Sweeps that make such runs: test_sweeps.py."""

from __future__ import annotations

import shutil

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from raytrain_lm.sweeps import TAG_TRIAL, TrialRuns
from raytrain_lm.sweeps.report import collect, format_table


def test_a_trial_that_trained_every_step_is_not_reported_stopped_early(tmp_path, learned_run):
    """Tune's stop reaches a trial after the report that made the scheduler stop it, and the
    trial may train to its last step meanwhile (ASHA stopped one at step 2 that went on to
    step 6 of 6). Such a trial is finished, in MLflow and in the report, and has its final
    model though the stop came before the trial could publish it (here: a trial whose run
    directory holds the 40-step checkpoint of the suite's shared run); one that did stop at
    step 2 is stopped early, at step 2 of 6, without one."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("stops")
    parent = client.create_run(experiment, run_name="stops")
    trials_dir = tmp_path / "trials"
    shutil.copytree(learned_run["output_dir"] / "learns", trials_dir / "stops-ran_all")
    runs = TrialRuns(uri, parent.info.run_id, str(trials_dir))
    for trial, last_step, planned in (("ran_all", 40, 40), ("stopped", 2, 6)):
        child = client.create_run(
            experiment,
            run_name=f"stops-{trial}",
            tags={"mlflow.parentRunId": parent.info.run_id, TAG_TRIAL: trial},
        )
        params = [
            Param("training.max_steps", str(planned)),
            Param("training.stop_after_step", "None"),
        ]
        losses = [Metric("train/loss", 5.0 - s / 10, 0, s) for s in range(1, last_step + 1)]
        client.log_batch(child.info.run_id, params=params, metrics=losses)
        # What CloseTrialRuns does when Tune's last result of the trial lacks `done_steps`.
        runs.close(runs.child(trial), "FINISHED", stopped_early=True)
    tags = {r.data.tags[TAG_TRIAL]: r.data.tags for r in runs.children()}
    assert "raytrain_lm.stopped_early" not in tags["ran_all"]
    assert tags["stopped"]["raytrain_lm.stopped_early"] == "true"
    ids = {r.data.tags[TAG_TRIAL]: r.info.run_id for r in runs.children()}
    final = {a.path for a in client.list_artifacts(ids["ran_all"], "final")}
    assert {"final/model.safetensors", "final/tokenizer.json"} <= final, final
    assert not client.list_artifacts(ids["stopped"], "final")
    rows = {line.split()[1]: line for line in format_table(collect(runs, []), []).splitlines()}
    assert " finished " in rows["ran_all"] and "stopped early" not in rows["ran_all"]
    assert " finished (stopped early at step 2 of 6) " in rows["stopped"]
