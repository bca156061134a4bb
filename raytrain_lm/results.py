"""Reading a run back after (or while) it trains: its metric history from MLflow as a
DataFrame, and text sampled from its newest complete checkpoint.

A run is named the way `train` names it: a run name under `output_dir`, or a run directory
(a sweep trial lives under `<output_dir>/<sweep name>/trials/`). The run directory records
which MLflow run and tracking store belong to it (`tracking.json`), so reading a run back
needs neither the config it was trained with nor `$MLFLOW_TRACKING_URI`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_lm.errors import UserError
from raytrain_lm.rundir import TRACKING_FILE, RunDir
from raytrain_lm.storage import is_uri, join

if TYPE_CHECKING:
    import pandas as pd


def run_directory(run: str | Path, output_dir: str | Path = "runs") -> RunDir:
    """The directory of `run` (local or in a bucket): `run` itself if it is a run directory,
    else `output_dir/run`."""
    for candidate in (str(run), join(output_dir, str(run))):
        if RunDir(candidate).is_run():
            return RunDir(candidate)
    where = output_dir if is_uri(output_dir) else Path(output_dir).resolve()
    raise UserError(f"no run named '{run}' (looked for it in {where}/)")


def mlflow_run(run: str | Path, output_dir: str | Path = "runs") -> tuple[str, str]:
    """(tracking URI, MLflow run id) of `run`."""
    record = run_directory(run, output_dir).read_text(TRACKING_FILE)
    if record is None:
        raise UserError(f"run '{run}' has no MLflow run (it was trained with tracking disabled)")
    fields = json.loads(record)
    return fields["tracking_uri"], fields["mlflow_run_id"]


def metric_history(
    run: str | Path, output_dir: str | Path = "runs", keys: list[str] | None = None
) -> pd.DataFrame:
    """Every logged value of the run's metrics, one row per step and one column per metric
    (`train/loss`, `val/loss`, `perf/tokens_per_s`, `world_size`, ...; default: all of them).

    Metrics logged at different intervals leave NaN where a metric has no value at a step
    (`df["val/loss"].dropna()` gives the validation curve). Steps trained twice, after a
    restart from an earlier checkpoint, keep the value logged last: the one that counts.
    """
    import pandas as pd  # a dependency of mlflow
    from mlflow.tracking import MlflowClient

    uri, run_id = mlflow_run(run, output_dir)
    client = MlflowClient(tracking_uri=uri)
    keys = keys if keys is not None else sorted(client.get_run(run_id).data.metrics)
    columns = {}
    for key in keys:
        by_step: dict[int, float] = {}
        for metric in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            by_step[metric.step] = metric.value
        columns[key] = pd.Series(by_step, dtype="float64")
    frame = pd.DataFrame(columns, columns=keys).sort_index()
    frame.index.name = "step"
    return frame


def checkpoint_models(run: str | Path, output_dir: str | Path = "runs") -> pd.DataFrame:
    """The run's checkpoints as MLflow logged models (tracking/models.py), one row per step:
    its losses, the checkpoint's location, whether it is still there (pruning removes all
    but `checkpoint.keep_last` and those promoted) and the model's id, for `raytrain-lm
    promote`."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from raytrain_lm.checkpoints import is_complete
    from raytrain_lm.tracking.models import CHECKPOINT_TAG, STEP_TAG, model_loss, run_models

    uri, run_id = mlflow_run(run, output_dir)
    rows = [
        {
            "step": int(model.tags[STEP_TAG]),
            "train_loss": model_loss(model, "train_loss"),
            "val_loss": model_loss(model, "val_loss"),
            "checkpoint": model.tags[CHECKPOINT_TAG],
            "kept": is_complete(model.tags[CHECKPOINT_TAG]),
            "model_id": model.model_id,
        }
        for model in run_models(MlflowClient(tracking_uri=uri), run_id)
    ]
    columns = ["step", "train_loss", "val_loss", "checkpoint", "kept", "model_id"]
    return pd.DataFrame(rows, columns=columns).set_index("step")


def sample(
    run: str | Path,
    prompt: str = "def ",
    max_new_tokens: int = 200,
    output_dir: str | Path = "runs",
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Text generated from `prompt` (included) by the run's newest complete checkpoint.

    `run` is a run name under `output_dir`, a run directory or a checkpoint folder; the same
    seed gives the same text. `max_new_tokens` and `top_k` (None: no limit) must be at least
    1 and `temperature` at least 0 (0: always the likeliest token), else `UserError`.
    """
    from raytrain_lm.generate import resolve_checkpoint
    from raytrain_lm.generate import sample as _sample

    checkpoint = resolve_checkpoint(str(run), str(output_dir))
    return _sample(checkpoint, prompt, max_new_tokens, temperature, top_k, seed)
