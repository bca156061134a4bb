"""Reading runs back (raytrain_lm.results): metric history from MLflow, samples from
checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

import raytrain_lm
from raytrain_lm.errors import UserError
from raytrain_lm.results import mlflow_run, run_directory


def _logged_run(tmp_path, metrics: list[tuple[str, float, int, int]]):
    """A run directory pointing at a real MLflow run (sqlite) holding `metrics`
    (key, value, timestamp ms, step), as `train` leaves one."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("results")).info.run_id
    client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in metrics])
    run_dir = tmp_path / "runs" / "logged"
    run_dir.mkdir(parents=True)
    (run_dir / "tracking.json").write_text(
        json.dumps({"tracking_uri": uri, "mlflow_run_id": run_id})
    )
    return run_dir, uri, run_id


def test_metric_history_one_row_per_step_last_value_wins(tmp_path):
    run_dir, uri, run_id = _logged_run(
        tmp_path,
        [
            ("train/loss", 5.0, 1000, 1),
            ("train/loss", 4.0, 1001, 2),
            ("val/loss", 4.5, 1001, 2),
            ("train/loss", 3.0, 1002, 3),
            # a restart from the step-2 checkpoint trains step 3 again: the later value counts
            ("train/loss", 3.5, 2000, 3),
            ("world_size", 2.0, 2000, 2),
        ],
    )
    assert mlflow_run("logged", tmp_path / "runs") == (uri, run_id)
    assert run_directory(run_dir).location == str(run_dir)

    history = raytrain_lm.metric_history("logged", output_dir=tmp_path / "runs")
    assert list(history.columns) == ["train/loss", "val/loss", "world_size"]
    assert history.index.name == "step" and history.index.tolist() == [1, 2, 3]
    assert history["train/loss"].tolist() == [5.0, 4.0, 3.5]
    assert history["val/loss"].dropna().to_dict() == {2: 4.5}
    assert np.isnan(history.loc[3, "world_size"])

    only = raytrain_lm.metric_history(run_dir, keys=["val/loss"])
    assert list(only.columns) == ["val/loss"] and only["val/loss"].tolist() == [4.5]


def test_unknown_runs_are_refused_with_where_we_looked(tmp_path):
    with pytest.raises(UserError, match="no run named 'nope'"):
        raytrain_lm.metric_history("nope", output_dir=tmp_path)
    untracked = tmp_path / "untracked"
    untracked.mkdir()
    (untracked / "events.jsonl").write_text("")
    with pytest.raises(UserError, match="tracking disabled"):
        raytrain_lm.metric_history("untracked", output_dir=tmp_path)
    with pytest.raises(UserError, match="no run or checkpoint named 'nope'"):
        raytrain_lm.sample("nope", output_dir=tmp_path)


def test_history_and_sample_of_a_trained_run(learned_run):
    runs, summary = learned_run["output_dir"], learned_run["summary"]
    history = raytrain_lm.metric_history("learns", output_dir=runs)
    assert history["train/loss"].dropna().index.tolist() == list(range(1, 41))
    assert history["val/loss"].dropna().index.tolist() == [20, 40]
    assert history.loc[40, "val/loss"] == pytest.approx(summary["val_loss"])

    text = raytrain_lm.sample("learns", prompt="def ", max_new_tokens=16, output_dir=runs)
    assert text.startswith("def ") and len(text) > len("def ")
    # the same seed, the same text; from the run directory as from its name
    assert raytrain_lm.sample(runs / "learns", max_new_tokens=16) == text
    # what `raytrain-lm generate` refuses, the API refuses too
    for bad in ({"max_new_tokens": -5}, {"top_k": 0}, {"temperature": -1.0}):
        with pytest.raises(UserError, match="must be at least"):
            raytrain_lm.sample("learns", output_dir=runs, **bad)
