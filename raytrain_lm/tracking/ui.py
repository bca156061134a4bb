"""How our runs look in MLflow's UI, and how to open it on the store a run logged to.

MLflow 3's UI opens an experiment in its GenAI view (traces, runs listed as "Evaluations")
unless told otherwise, and lays a run's metric charts out in sections named by the metrics'
prefixes, alphabetically: `train/loss` would come after `cost/`, `data/`, `goodput/` and
`perf/`. So every experiment our runs log to (created by us, or found) carries two tags:

- `mlflow.experimentKind`: `custom_model_development`, what MLflow's own kind selector writes
  for a training experiment (UIs that choose the view by the experiment's kind read it);
- a saved view, `mlflow.sharedViewState.training` (MLflow 3.17's "Views" menu on the runs
  page): the runs' charts with the loss curves first, train and validation in one chart,
  then the sections a reader of a training run looks at next.

MLflow 3.17 itself takes the view from the sidebar's GenAI / Model training switch (kept in
the browser) or from a link's `workflowType`; a run page keeps its chart layout in the
browser only. The link we print (`experiment_link`) therefore names the training view, the
chart mode and the saved view.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from urllib.parse import urlencode

KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
TRAINING_VIEW = "training"
TRAINING_VIEW_TAG = SAVED_VIEW_PREFIX + TRAINING_VIEW
# What `mlflow ui` serves on when started as the README says (its defaults).
UI_ADDRESS = "http://127.0.0.1:5000"
LOSS_SECTION = "loss"
LOSS_METRICS = ["train/loss", "val/loss"]
# The sections after the loss, in reading order; MLflow appends any others (a replica or
# DiLoCo run's) after these, then the unprefixed "Model metrics" and the system metrics.
SECTIONS_AFTER_LOSS = ["train", "val", "perf", "goodput", "cost", "time"]


def training_view_state() -> dict:
    """The UI state the saved view restores: the keys of MLflow's runs-page state that it
    reads back from a saved view (compareRunCharts, compareRunSections, isAccordionReordered),
    with the chart and section records as MLflow's UI writes them."""
    sections = [LOSS_SECTION, *SECTIONS_AFTER_LOSS]
    loss_chart = {
        "uuid": "raytrain-lm-loss",
        "type": "LINE",
        "runsCountToCompare": 10,
        "metricSectionId": _section_id(LOSS_SECTION),
        "deleted": False,
        "isGenerated": False,
        "displayName": "loss (train, val)",
        "metricKey": LOSS_METRICS[0],
        "selectedMetricKeys": LOSS_METRICS,
        "lineSmoothness": 0,
        "xAxisScaleType": "linear",
        "scaleType": "linear",
        "range": {},
        "xAxisKey": "step",
        "selectedXAxisMetricKey": "",
        "yAxisKey": "metric",
        "yAxisExpressions": [],
        "ignoreOutliers": False,
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }
    return {
        "compareRunCharts": [loss_chart],
        "compareRunSections": [
            {
                "uuid": _section_id(name),
                "name": name,
                "display": True,
                # The UI inserts a new chart alphabetically into a section not reordered:
                # ours keep the loss first and append the others after it.
                "isReordered": name == LOSS_SECTION,
                "deleted": False,
                "isGenerated": True,
            }
            for name in sections
        ],
        # Keeps this section order instead of sorting the sections by name.
        "isAccordionReordered": True,
    }


def _section_id(name: str) -> str:
    return f"raytrain-lm-section-{name}"


def training_view_tag_value(created_ms: int) -> str:
    """The saved view as MLflow stores it: an envelope naming it, its state as JSON text."""
    return json.dumps(
        {
            "name": "training: loss first",
            "createdAt": created_ms,
            "updatedAt": created_ms,
            "state": json.dumps(training_view_state(), separators=(",", ":")),
        },
        separators=(",", ":"),
    )


def open_experiment(client, name: str, uri: str) -> str:
    """The id of experiment `name`, created if missing (on a local sqlite store with its
    artifacts beside the database), with the training view's tags set where missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            experiment_id = client.create_experiment(
                name, artifact_location=_artifact_location(uri, name)
            )
        except Exception:
            # Another run of this store created it meanwhile; anything else stays an error.
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
        else:
            found = client.get_experiment(experiment_id)
    if found.tags.get(KIND_TAG) != TRAINING_KIND:
        client.set_experiment_tag(found.experiment_id, KIND_TAG, TRAINING_KIND)
    if TRAINING_VIEW_TAG not in found.tags:
        # Set once: a user who saves their own layout over it in the UI keeps theirs.
        value = training_view_tag_value(int(time.time() * 1000))
        client.set_experiment_tag(found.experiment_id, TRAINING_VIEW_TAG, value)
    return found.experiment_id


def _artifact_location(uri: str, experiment: str) -> str | None:
    """`mlruns/<experiment>` beside a local sqlite database. MLflow's default is `./mlruns`
    of whatever folder first created the experiment: a notebook's folder, or a cluster job's
    throwaway copy of the working directory, whose artifacts would vanish with it."""
    if not uri.startswith("sqlite:///"):
        return None  # a server decides where its artifacts go
    database = uri.removeprefix("sqlite:///").partition("?")[0]
    if database.startswith(":memory:") or not os.path.isabs(database):
        return None
    folder = re.sub(r"[^A-Za-z0-9._-]+", "-", experiment).strip("-.") or "experiment"
    return str(Path(database).parent / "mlruns" / folder)


def experiment_link(experiment_id: str, address: str = UI_ADDRESS) -> str:
    """The experiment's runs in MLflow's training view, charts shown, the saved view open."""
    query = urlencode(
        {
            "workflowType": "machine_learning",
            "compareRunsMode": "CHART",
            "viewStateShareKey": TRAINING_VIEW,
        }
    )
    return f"{address.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def ui_command(uri: str, working_dir: str | Path = ".") -> str | None:
    """The `mlflow ui` command that shows the local store `uri` (relative when the store is
    in `working_dir`, as the README writes it); None for a tracking server."""
    if uri.startswith(("http://", "https://")):
        return None
    if uri.startswith("sqlite:///"):
        database = uri.removeprefix("sqlite:///")
        here = Path(working_dir).resolve()
        if os.path.isabs(database) and Path(database).parent == here:
            uri = f"sqlite:///{Path(database).name}"
    return f"mlflow ui --backend-store-uri {uri}"


def where_to_look(uri: str, mlflow_run_id: str, working_dir: str | Path = ".") -> str:
    """One line: how to open the run's experiment in MLflow's UI."""
    from mlflow.tracking import MlflowClient

    command = ui_command(uri, working_dir)
    try:
        experiment_id = MlflowClient(tracking_uri=uri).get_run(mlflow_run_id).info.experiment_id
    except Exception:
        # A store gone after the run ended (its metrics are spooled): the command still holds.
        return f"MLflow: `{command}`" if command else f"MLflow: {uri}"
    if command is None:
        return f"MLflow: {experiment_link(experiment_id, uri)}"
    return f"MLflow: `{command}`, then open {experiment_link(experiment_id)}"
