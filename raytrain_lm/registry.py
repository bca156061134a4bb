"""Checkpoints in MLflow's Model Registry: `raytrain-lm promote` registers one of a run's
checkpoint models (tracking/models.py) as a version of a registered model with an alias, and
`models:/NAME@ALIAS` (or `models:/NAME/VERSION`) names that checkpoint wherever a run or a
checkpoint is accepted (`generate`, `export`, `eval`).

A version names the checkpoint's own location (its source, for a bucket; a tag, and the logged
model as its source, for a folder): the registry copies no bytes. The
checkpoint is marked to be kept (`KEEP_FILE`) so that pruning never takes what a version
points at.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from raytrain_lm import audit
from raytrain_lm.checkpoints import KEEP_FILE, is_complete
from raytrain_lm.config.tracking import TrackingConfig
from raytrain_lm.errors import UserError
from raytrain_lm.results import mlflow_run, run_directory
from raytrain_lm.storage import is_uri, join, write_bytes
from raytrain_lm.tracking.models import CHECKPOINT_TAG, STEP_TAG, model_loss, run_models
from raytrain_lm.tracking.store import refusal, retry_on_our_schedule

MODELS_PREFIX = "models:/"
MODEL_ID_TAG = "raytrain_lm.model_id"
RANKED_BY = ("val_loss", "train_loss")


@dataclass(frozen=True)
class Promoted:
    name: str
    version: str
    alias: str
    step: int
    checkpoint: str
    tracking_uri: str


def promote(
    run: str,
    name: str,
    alias: str,
    output_dir: str = "runs",
    step: int | None = None,
    best: str | None = None,
) -> Promoted:
    """Registers the run's checkpoint model at `step`, else the one with the lowest `best`
    loss, else its newest, as a new version of `name`, and points `alias` at it."""
    uri, run_id = mlflow_run(run, output_dir)
    run_dir = run_directory(run, output_dir)
    client = _client(uri)
    with _refused_as_user_errors(uri):
        models = run_models(client, run_id)
        if not models:
            raise UserError(
                f"run '{run}' has no checkpoint logged as a model in {uri}: it logs one per "
                "complete checkpoint (checkpoint.every_steps)"
            )
        chosen = _choose(run, models, step, best)
        location = chosen.tags[CHECKPOINT_TAG]
        if not is_complete(location):
            kept = [int(m.tags[STEP_TAG]) for m in models if is_complete(m.tags[CHECKPOINT_TAG])]
            raise UserError(
                f"the checkpoint of step {chosen.tags[STEP_TAG]} ({location}) is gone, pruned "
                f"by checkpoint.keep_last; complete ones are at steps {kept or 'none'}"
            )
        record = audit.new_record("promote", run=run_dir.name, mlflow_run=run_id)
        record["model"] = {"name": name, "alias": alias, "step": int(chosen.tags[STEP_TAG])}
        audit.write(audit.storage_of(run_dir.parent), record)
        write_bytes(join(location, KEEP_FILE), f"registered as {name}\n".encode())
        _ensure_registered(client, name)
        # A server takes a local folder as a source only inside the run's artifacts: a
        # folder's version names the logged model instead, which names the folder.
        version = client.create_model_version(
            name,
            source=str(location) if is_uri(location) else f"models:/{chosen.model_id}",
            run_id=run_id,
            tags={
                MODEL_ID_TAG: chosen.model_id,
                STEP_TAG: chosen.tags[STEP_TAG],
                CHECKPOINT_TAG: str(location),
            },
            model_id=chosen.model_id,
        )
        client.set_registered_model_alias(name, alias, version.version)
        client.set_tag(run_id, f"{audit.TAG_PREFIX}promote.{name}.v{version.version}",
                       f"@{alias} by {record['user']}@{record['host']} at {record['time']}")  # fmt: skip
    return Promoted(name, str(version.version), alias, int(chosen.tags[STEP_TAG]), location, uri)


def checkpoint_of(reference: str) -> str:
    """The checkpoint a `models:/NAME@ALIAS` or `models:/NAME/VERSION` names (in the store
    of `MLFLOW_TRACKING_URI`, else ./mlflow.db, as a run's default); anything else is
    returned as it is (a run name, a run or checkpoint folder)."""
    if not reference.startswith(MODELS_PREFIX):
        return reference
    body = reference.removeprefix(MODELS_PREFIX)
    name, at, alias = body.partition("@")
    name, slash, number = name.partition("/") if not at else (name, "", "")
    if not name or not (alias or number):
        raise UserError(f"{reference}: write models:/NAME@ALIAS or models:/NAME/VERSION")
    uri = TrackingConfig().store_uri(os.getcwd())
    client = _client(uri)
    with _refused_as_user_errors(uri, f"no model version {reference} in {uri}"):
        found = (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, number)
        )
    location = found.tags.get(CHECKPOINT_TAG, found.source)
    if not is_complete(location):
        raise UserError(f"{reference} is {location}, which holds no complete checkpoint")
    return location


def _choose(run: str, models: list, step: int | None, best: str | None):
    if step is not None:
        at_step = [m for m in models if int(m.tags[STEP_TAG]) == step]
        if not at_step:
            steps = [int(m.tags[STEP_TAG]) for m in models]
            raise UserError(f"run '{run}' has no checkpoint model at step {step}; it has {steps}")
        return at_step[0]
    if best is None:
        return models[-1]
    scored = [(model_loss(m, best), int(m.tags[STEP_TAG]), m) for m in models]
    scored = [item for item in scored if item[0] is not None]
    if not scored:
        raise UserError(f"no checkpoint model of run '{run}' has a {best} (was it evaluated?)")
    return min(scored, key=lambda item: item[:2])[2]


def _ensure_registered(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if exc.get_http_status_code() != 404:
            raise
        client.create_registered_model(name)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    retry_on_our_schedule(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


class _refused_as_user_errors:
    """A refused login, missing rights or (with `missing`) what is not there, in one line."""

    def __init__(self, uri: str, missing: str | None = None):
        self.uri, self.missing = uri, missing

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        from mlflow.exceptions import MlflowException

        if not isinstance(exc, MlflowException):
            return False
        refused = refusal(exc, self.uri, "its experiment")
        if refused is not None:
            raise refused from None
        if self.missing and exc.get_http_status_code() in (400, 404):
            raise UserError(f"{self.missing} ({exc.message})") from None
        if exc.get_http_status_code() == 400:
            raise UserError(f"tracking store {self.uri}: {exc.message}") from None
        return False
