"""Checkpoints as MLflow models (tracking/models.py) and the Model Registry (registry.py): a run
logs each complete checkpoint as a `LoggedModel`, `raytrain-lm promote` registers one with an
alias, and `generate` samples it through `models:/NAME@ALIAS`, as a user types them."""

from __future__ import annotations

import pytest
from conftest import shared_run_overrides

import raytrain_lm
from raytrain_lm import audit, cli
from raytrain_lm.checkpoints import (
    KEEP_FILE,
    complete_checkpoints,
    is_complete,
    prune_checkpoints,
    read_state,
)
from raytrain_lm.config import load_config
from raytrain_lm.errors import UserError
from raytrain_lm.results import mlflow_run
from raytrain_lm.tracking.models import CHECKPOINT_TAG, STEP_TAG, model_loss, run_models


@pytest.fixture(scope="module")
def promoted_run(tmp_path_factory, shared_dirs, ray_session):
    """30 steps, a checkpoint and an evaluation every 10, the last 2 checkpoints kept."""
    runs = tmp_path_factory.mktemp("registry") / "runs"
    overrides = [
        *shared_run_overrides(runs, shared_dirs),
        "name=registered",
        "training.max_steps=30",
        "training.eval_every=10",
        "checkpoint.every_steps=10",
        "checkpoint.keep_last=2",
    ]
    raytrain_lm.train(load_config(None, overrides), sample=False)
    return runs


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_each_complete_checkpoint_is_a_model_of_its_run(promoted_run):
    uri, run_id = mlflow_run("registered", promoted_run)
    client = _client(uri)
    models = run_models(client, run_id)
    assert [int(m.tags[STEP_TAG]) for m in models] == [10, 20, 30]
    run = client.get_run(run_id)
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    for model in models:
        step = int(model.tags[STEP_TAG])
        location = model.tags[CHECKPOINT_TAG]
        assert location.startswith(f"{promoted_run}/registered/checkpoint_")
        # where the run wrote that step's checkpoint; step 10's is pruned (keep_last=2)
        assert is_complete(location) == (step > 10)
        assert step == 10 or read_state(location).step == step
        assert model.source_run_id == run_id and model.params["step"] == str(step)
        linked = {m.key: m for m in model.metrics}
        assert set(linked) == {"checkpoint/train_loss", "checkpoint/val_loss"}
        assert all(m.step == step and m.dataset_digest == dataset.digest for m in linked.values())
        assert all(m.dataset_name == dataset.name for m in linked.values())
    val = {int(m.tags[STEP_TAG]): model_loss(m, "val_loss") for m in models}
    history = {m.step: m.value for m in client.get_metric_history(run_id, "val/loss")}
    assert val == pytest.approx(history)  # the losses the run logged at those steps
    outputs = {(o.model_id, o.step) for o in run.outputs.model_outputs}
    assert outputs == {(m.model_id, int(m.tags[STEP_TAG])) for m in models}

    table = raytrain_lm.checkpoint_models("registered", output_dir=promoted_run)  # notebook 01's
    assert table.index.tolist() == [10, 20, 30] and table["kept"].tolist() == [False, True, True]
    assert table["val_loss"].to_dict() == val and table["model_id"].tolist() == [
        m.model_id for m in models
    ]


def test_promote_the_best_then_sample_it_through_its_alias(promoted_run, monkeypatch, capsys):
    uri, run_id = mlflow_run("registered", promoted_run)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(UserError, match="step 10 .* is not there: pruned by checkpoint.keep_last"):
        cli.run(["promote", "registered", "--step", "10", "--name", "tiny-lm",
                 "--output-dir", str(promoted_run)])  # fmt: skip
    with pytest.raises(UserError, match=r"no checkpoint model at step 15; it has \[10, 20, 30\]"):
        cli.run(["promote", "registered", "--step", "15", "--name", "tiny-lm",
                 "--output-dir", str(promoted_run)])  # fmt: skip
    assert not _client(uri).search_registered_models("name = 'tiny-lm'")  # nothing registered

    models = run_models(_client(uri), run_id)
    best = min(models[1:], key=lambda m: model_loss(m, "val_loss"))  # step 10's was pruned
    code = cli.run(["promote", "registered", "--best", "val_loss", "--name", "tiny-lm",
                    "--alias", "champion", "--output-dir", str(promoted_run)])  # fmt: skip
    said = capsys.readouterr().out
    assert code == 0 and "models:/tiny-lm@champion" in said, said
    version = _client(uri).get_model_version_by_alias("tiny-lm", "champion")
    location = best.tags[CHECKPOINT_TAG]
    assert version.source == f"models:/{best.model_id}" and version.run_id == run_id  # a folder
    assert version.tags == {
        "raytrain_lm.model_id": best.model_id,
        STEP_TAG: best.tags[STEP_TAG],
        CHECKPOINT_TAG: location,
    }

    # The promotion is in the audit log beside the runs (the refused ones left none) and on
    # the MLflow run.
    (record,) = audit.read(promoted_run.parent)
    assert record["action"] == "promote" and record["mlflow_run"] == run_id
    assert record["model"] == {
        "name": "tiny-lm",
        "alias": "champion",
        "step": int(best.tags[STEP_TAG]),
    }
    tag = _client(uri).get_run(run_id).data.tags[f"{audit.TAG_PREFIX}promote.tiny-lm.v1"]
    assert tag.startswith(f"@champion by {record['user']}@")

    sample = ["--prompt", "def ", "--tokens", "8", "--seed", "3"]
    assert cli.run(["generate", "--run", "models:/tiny-lm@champion", *sample]) == 0
    through_alias = capsys.readouterr().out
    assert cli.run(["generate", "--run", location, *sample]) == 0
    assert capsys.readouterr().out == through_alias
    assert cli.run(["generate", "--run", "models:/tiny-lm/1", *sample]) == 0
    assert capsys.readouterr().out == through_alias
    with pytest.raises(UserError, match="no model version models:/tiny-lm@nobody in"):
        cli.run(["generate", "--run", "models:/tiny-lm@nobody"])

    # The registry points at the checkpoint's own bytes: pruning leaves a promoted one.
    run_dir = promoted_run / "registered"
    assert (run_dir / location.rsplit("/", 1)[-1] / KEEP_FILE).is_file()
    prune_checkpoints(run_dir, keep_last=1, keep_best=False)
    kept = [str(c) for c in complete_checkpoints(run_dir)]
    assert location in kept and kept[-1] == models[-1].tags[CHECKPOINT_TAG]
