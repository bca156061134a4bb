"""Which MLflow run a tracker logs to: the one it logged to before, else its sweep trial's
run if that exists, else a new one."""

from __future__ import annotations

from raytrain_lm.tracking.store import is_permanent
from raytrain_lm.tracking.ui import open_experiment


def open_run(
    uri: str,
    experiment: str,
    run_name: str,
    run_id: str | None,
    parent_run_id: str | None,
) -> str:
    """The id of a run marked RUNNING: `run_id` when given (a resumed run) and still in the
    store, else the child of `parent_run_id` named `run_name` if one exists (a trial restarted
    before it recorded its run id), else a new run, nested under `parent_run_id` when given."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    # Also for a resumed run: an experiment made before the training view had no tags.
    experiment_id = open_experiment(client, experiment, uri)
    if run_id is not None:
        try:
            client.update_run(run_id, status="RUNNING")
            return run_id
        except Exception as exc:
            if not is_permanent(exc):
                raise  # the store is down: wait for it, do not open a second run
            # the run is gone (a store that was reset): start afresh rather than fail
    existing = []
    if parent_run_id is not None:
        existing = client.search_runs(
            [experiment_id],
            f"tags.`mlflow.parentRunId` = '{parent_run_id}' and attributes.run_name = '{run_name}'",
            max_results=1,
        )
    if existing:
        client.update_run(existing[0].info.run_id, status="RUNNING")
        return existing[0].info.run_id
    nested = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
    return client.create_run(experiment_id, run_name=run_name, tags=nested).info.run_id
