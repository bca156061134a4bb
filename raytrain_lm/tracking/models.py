"""Each complete checkpoint as an MLflow `LoggedModel` of its run, and the run's checkpoint
models read back (`promote`, registry.py).

A model is logged once its checkpoint's marker is written: by rank 0, from the tracker's
background thread, so that neither a step nor an upload waits on the store. Its weights stay
where the checkpoint is: MLflow's model holds the checkpoint's location as a tag, its step, the
losses at that step linked to it (with the run's dataset input, the manifest's digest), and
the run names it among its outputs at that step. Logging is idempotent per checkpoint: a retry
after an outage finds the model already there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODEL_TYPE = "raytrain-lm checkpoint"
STEP_TAG, CHECKPOINT_TAG = "raytrain_lm.step", "raytrain_lm.checkpoint"
# The model's own metrics: the run's `train/loss` and `val/loss` curves stay free of
# duplicate points at checkpoint steps.
MODEL_METRICS = {"train_loss": "checkpoint/train_loss", "val_loss": "checkpoint/val_loss"}


@dataclass(frozen=True)
class CheckpointModel:
    step: int
    location: str  # the complete checkpoint's folder or bucket prefix
    losses: dict[str, float]  # train_loss, val_loss (the newest evaluation) where known

    @classmethod
    def of(cls, step: int, location: str, report: dict) -> CheckpointModel:
        losses = {
            key: float(report[key])
            for key in MODEL_METRICS
            if isinstance(report.get(key), int | float) and math.isfinite(report[key])
        }
        return cls(step, location, losses)


def run_models(client, run_id: str, ready_only: bool = True, run=None) -> list:
    """The run's checkpoint models by step, then by when they were logged (a step trained
    again after a restart has a model per checkpoint): ready ones (else also those left
    pending by an outage between their creation and their end). `run`: the run, if read."""
    experiment_id = (run or client.get_run(run_id)).info.experiment_id
    found, token = [], None
    while True:
        page = client.search_logged_models(
            [experiment_id], filter_string=f"source_run_id = '{run_id}'", page_token=token
        )
        found.extend(page)
        token = page.token
        if not token:
            break
    ours = [m for m in found if m.model_type == MODEL_TYPE and STEP_TAG in m.tags]
    if ready_only:
        ours = [m for m in ours if str(m.status).endswith("READY")]
    return sorted(ours, key=lambda m: (int(m.tags[STEP_TAG]), m.creation_timestamp))


def log_checkpoint_model(client, run_id: str, model: CheckpointModel) -> str:
    """Logs `model` unless the run has one ready for its checkpoint; returns its model id."""
    from mlflow.entities import LoggedModelOutput

    run = client.get_run(run_id)
    for existing in run_models(client, run_id, ready_only=False, run=run):
        if existing.tags.get(CHECKPOINT_TAG) != model.location:
            continue
        if str(existing.status).endswith("READY"):
            return existing.model_id
        client.finalize_logged_model(existing.model_id, "FAILED")  # half-logged before
    datasets = run.inputs.dataset_inputs if run.inputs else []
    dataset = datasets[0].dataset if datasets else None
    logged = client.create_logged_model(
        run.info.experiment_id,
        name=f"{run.info.run_name}-step-{model.step}",
        source_run_id=run_id,
        params={"step": str(model.step), "checkpoint": model.location},
        tags={STEP_TAG: str(model.step), CHECKPOINT_TAG: model.location},
        model_type=MODEL_TYPE,
    )
    for key, value in model.losses.items():
        client.log_metric(
            run_id,
            MODEL_METRICS[key],
            value,
            step=model.step,
            model_id=logged.model_id,
            dataset_name=dataset.name if dataset else None,
            dataset_digest=dataset.digest if dataset else None,
        )
    # READY last: a model is ready only once everything about it is stored
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, model.step)])
    client.finalize_logged_model(logged.model_id, "READY")
    return logged.model_id


def model_loss(model, key: str) -> float | None:
    """The model's `train_loss` or `val_loss` (None: not logged)."""
    values = [m.value for m in model.metrics or [] if m.key == MODEL_METRICS[key]]
    return values[-1] if values else None
