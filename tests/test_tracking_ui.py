"""What MLflow's UI shows of our runs: their experiment opens in its training view, the loss
curves first, and the line a run ends with says how to open it.

Asserted on a real sqlite store, on the tags MLflow 3's UI reads, and against that UI's own
code, the JavaScript that ships inside the installed MLflow: the kind tag and value, the
saved-view tag prefix, the runs-page state a saved view restores, the fields of its chart and
section records, and the link's parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.tracking.ui import (
    KIND_TAG,
    SAVED_VIEW_PREFIX,
    TRAINING_KIND,
    TRAINING_VIEW,
    TRAINING_VIEW_TAG,
    experiment_link,
    training_view_state,
    ui_command,
    where_to_look,
)

UI_CODE = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"


@pytest.fixture(scope="module")
def ui_code() -> str:
    """MLflow's UI as the browser runs it."""
    return "\n".join(path.read_text(errors="replace") for path in UI_CODE.glob("*.js"))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module (making one costs seconds); tests use experiments of
    their own in it."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def _listed(code: str, first_items: str) -> list[str]:
    """The JavaScript array literal of strings that starts with `first_items`."""
    found = re.search(r"\[" + re.escape(first_items) + r'(?:,"\w+")*\]', code)
    assert found, f"MLflow's UI has no list starting {first_items}: the UI changed"
    return json.loads(found.group(0))


def _fields(code: str, class_start: str) -> set[str]:
    """The fields a constructor of MLflow's UI that starts with `class_start` sets."""
    found = re.search(re.escape(class_start) + r"(.*?)\}(?:\}|static )", code)
    assert found, f"MLflow's UI has no {class_start!r}: the UI changed"
    return set(re.findall(r"this\.(\w+)=", class_start + found.group(1)))


def _start(uri: str, experiment: str, run_name: str = "run") -> MLflowTracker:
    tracker = MLflowTracker.start(uri, experiment, run_name, None, wait_s=0)
    tracker.finish()
    return tracker


def test_a_new_experiment_opens_in_the_training_view_with_the_loss_first(store):
    tracker = _start(store, "fresh")
    client = MlflowClient(tracking_uri=store)
    tags = client.get_experiment_by_name("fresh").tags
    assert tags[KIND_TAG] == TRAINING_KIND
    # Read as MLflow's UI reads a saved view: an envelope, then its state as JSON text.
    view = json.loads(tags[TRAINING_VIEW_TAG])
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int)
    state = json.loads(view["state"])
    first_section = state["compareRunSections"][0]
    first_chart = state["compareRunCharts"][0]
    assert first_chart["metricSectionId"] == first_section["uuid"]
    assert first_chart["type"] == "LINE"
    assert first_chart["selectedMetricKeys"] == ["train/loss", "val/loss"]
    assert state["isAccordionReordered"] is True  # the sections stay in this order
    assert tracker.run_id in {
        r.info.run_id for r in client.search_runs([tracker_experiment(tracker)])
    }


def tracker_experiment(tracker: MLflowTracker) -> str:
    return tracker.client.get_run(tracker.run_id).info.experiment_id


def test_an_older_experiment_gets_the_view_and_a_users_own_view_is_kept(store):
    client = MlflowClient(tracking_uri=store)
    experiment_id = client.create_experiment("older")  # as runs made it before
    assert KIND_TAG not in client.get_experiment(experiment_id).tags
    _start(store, "older")
    tags = client.get_experiment(experiment_id).tags
    assert tags[KIND_TAG] == TRAINING_KIND and TRAINING_VIEW_TAG in tags

    # The user saves their own layout over ours in the UI: the next run leaves it alone.
    mine = json.dumps({"name": "mine", "createdAt": 1, "state": "{}"})
    client.set_experiment_tag(experiment_id, TRAINING_VIEW_TAG, mine)
    _start(store, "older", "second")
    assert client.get_experiment(experiment_id).tags[TRAINING_VIEW_TAG] == mine


def test_the_saved_view_is_what_mlflows_ui_restores(ui_code):
    assert f'"{KIND_TAG}"' in ui_code and f'"{TRAINING_KIND}"' in ui_code
    assert f'"{SAVED_VIEW_PREFIX}"' in ui_code
    # A saved view restores these keys of the runs page's state, less those it never shares.
    restored = set(_listed(ui_code, '"selectedColumns","columnOrder"'))
    restored -= set(_listed(ui_code, '"runsExpanded","runsPinned"'))
    state = training_view_state()
    assert set(state) <= restored, set(state) - restored
    # A chart record: the base card's fields and a line chart's, as the UI constructs them.
    card = _fields(ui_code, "constructor(e,t,n){this.uuid=void 0,")
    card |= _fields(ui_code, "super(...e),this.type=c.LINE,")
    for chart in state["compareRunCharts"]:
        assert set(chart) <= card, set(chart) - card
    for section in state["compareRunSections"]:
        assert set(section) == {"uuid", "name", "display", "isReordered", "deleted", "isGenerated"}


def test_the_link_opens_the_training_view_the_charts_and_the_saved_view(ui_code):
    link = experiment_link("7")
    assert link.startswith("http://127.0.0.1:5000/#/experiments/7/runs?")
    asked = dict(pair.split("=") for pair in link.partition("?")[2].split("&"))
    assert asked == {
        "workflowType": "machine_learning",
        "compareRunsMode": "CHART",
        "viewStateShareKey": TRAINING_VIEW,
    }
    # The UI reads each of these from the link, and knows each value.
    for name in asked:
        assert f'"{name}"' in ui_code, name
    assert 'MACHINE_LEARNING="machine_learning"' in ui_code and '"CHART"' in ui_code


def test_a_run_ends_with_the_command_and_link_to_look_at_it(store, tmp_path, monkeypatch):
    tracker = _start(store, "hint")
    database = Path(store.removeprefix("sqlite:///"))
    line = where_to_look(store, tracker.run_id, working_dir=database.parent)
    assert line == (
        "MLflow: `mlflow ui --backend-store-uri sqlite:///mlflow.db`, then open "
        + experiment_link(tracker_experiment(tracker))
    )
    # From another folder the store is named whole; a server is its own UI.
    assert ui_command(store, tmp_path) == f"mlflow ui --backend-store-uri {store}"
    assert ui_command("http://127.0.0.1:5001", tmp_path) is None
    # A run the store cannot show now still gets the command, and the CLI no traceback.
    gone = where_to_look(store, "0" * 32, working_dir=tmp_path)
    assert gone == f"MLflow: `mlflow ui --backend-store-uri {store}`"


def test_artifacts_sit_beside_the_sqlite_store_whoever_made_the_experiment(
    store, tmp_path, monkeypatch
):
    # A run started in another folder (a notebook's, a cluster job's copy of the checkout)
    # still keeps its artifacts beside the store, not in that folder's ./mlruns.
    monkeypatch.chdir(tmp_path)
    tracker = MLflowTracker.start(store, "artifacts here", "run", None, wait_s=0)
    (tmp_path / "note.txt").write_text("kept")
    tracker.log_artifact(tmp_path / "note.txt")
    tracker.finish()
    database = Path(store.removeprefix("sqlite:///"))
    kept = database.parent / "mlruns" / "artifacts-here" / tracker.run_id / "artifacts"
    assert (kept / "note.txt").read_text() == "kept"
    assert not (tmp_path / "mlruns").exists()
