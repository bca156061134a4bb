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

import contextlib
import os
from dataclasses import dataclass

from raytrain_lm import audit
from raytrain_lm.checkpoints import KEEP_FILE, is_complete
from raytrain_lm.config.tracking import TrackingConfig
from raytrain_lm.errors import UserError
from raytrain_lm.results import mlflow_run, run_directory
from raytrain_lm.storage import exists, filesystem, is_uri, join, write_bytes
from raytrain_lm.tracking.models import CHECKPOINT_TAG, STEP_TAG, model_loss, run_models
from raytrain_lm.tracking.store import USERNAME_ENV, refused_login, retry_on_our_schedule

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
    loss, else its newest, as a new version of `name`, and points `alias` at it. Only a
    checkpoint that is still there (complete) can be promoted."""
    uri, run_id = mlflow_run(run, output_dir)
    run_dir = run_directory(run, output_dir)
    client = _client(uri)
    with _refused_as_user_errors(uri, f"register model '{name}'"):
        models = run_models(client, run_id)
        if not models:
            raise UserError(
                f"run '{run}' has no checkpoint logged as a model in {uri}: it logs one per "
                "complete checkpoint (checkpoint.every_steps)"
            )
        chosen = _choose(run, models, step, best)
        location, chosen_step = chosen.tags[CHECKPOINT_TAG], int(chosen.tags[STEP_TAG])
        record = audit.new_record("promote", run=run_dir.name, mlflow_run=run_id)
        record["model"] = {"name": name, "alias": alias, "step": chosen_step}
        audit.write(audit.storage_of(run_dir.parent), record)
        version = _register(client, name, alias, run_id, chosen)
        client.set_tag(run_id, f"{audit.TAG_PREFIX}promote.{name}.v{version.version}",
                       f"@{alias} by {record['user']}@{record['host']} at {record['time']}")  # fmt: skip
    return Promoted(name, str(version.version), alias, chosen_step, location, uri)


def _register(client, name: str, alias: str, run_id: str, chosen):
    """A new version of `name` pointing at `chosen`'s checkpoint, which is kept from pruning
    from then on (its KEEP file, removed again if registering fails)."""
    location, step = chosen.tags[CHECKPOINT_TAG], chosen.tags[STEP_TAG]
    keep = join(location, KEEP_FILE)
    kept_before = exists(keep)
    write_bytes(keep, f"registered as {name}\n".encode())
    try:
        if not is_complete(location):  # pruned between the choice and the KEEP file
            raise UserError(f"the checkpoint of step {step} ({location}) was pruned meanwhile")
        _ensure_registered(client, name)
        # A server takes a local folder as a source only inside the run's artifacts: a
        # folder's version names the logged model instead, which names the folder.
        version = client.create_model_version(
            name,
            source=str(location) if is_uri(location) else f"models:/{chosen.model_id}",
            run_id=run_id,
            tags={MODEL_ID_TAG: chosen.model_id, STEP_TAG: step, CHECKPOINT_TAG: str(location)},
            model_id=chosen.model_id,
        )
        client.set_registered_model_alias(name, alias, version.version)
    except BaseException:
        if not kept_before:
            fs, inner = filesystem(keep)
            with contextlib.suppress(OSError):
                fs.delete_file(inner)
        raise
    return version


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
    with _refused_as_user_errors(
        uri, f"read {reference}", f"no model version {reference} in {uri}"
    ):
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
    """The model at `step` (its newest checkpoint there), else the lowest `best`, else the
    newest, among those whose checkpoint is still there."""
    there = [m for m in models if is_complete(m.tags[CHECKPOINT_TAG])]
    there_steps = sorted({int(m.tags[STEP_TAG]) for m in there})
    gone = "pruned by checkpoint.keep_last, or not reachable from this machine"
    if step is not None:
        at_step = [m for m in models if int(m.tags[STEP_TAG]) == step]
        if not at_step:
            steps = sorted({int(m.tags[STEP_TAG]) for m in models})
            raise UserError(f"run '{run}' has no checkpoint model at step {step}; it has {steps}")
        if not [m for m in at_step if m in there]:
            raise UserError(
                f"the checkpoint of step {step} ({at_step[-1].tags[CHECKPOINT_TAG]}) is not "
                f"there: {gone}; checkpoints there: steps {there_steps or 'none'}"
            )
        return [m for m in at_step if m in there][-1]
    if not there:
        raise UserError(f"none of run '{run}'s checkpoint models has its checkpoint there: {gone}")
    if best is None:
        return there[-1]
    scored = [(model_loss(m, best), int(m.tags[STEP_TAG]), m) for m in there]
    scored = [item for item in scored if item[0] is not None]
    if not scored:
        raise UserError(
            f"no checkpoint of run '{run}' that is there has a {best} measured at its step "
            f"(steps {there_steps}; training.eval_every and checkpoint.every_steps)"
        )
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
    """A refused login, missing rights to `action` or (with `missing`) what is not there, in
    one line."""

    def __init__(self, uri: str, action: str, missing: str | None = None):
        self.uri, self.action, self.missing = uri, action, missing

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        from mlflow.exceptions import MlflowException

        if not isinstance(exc, MlflowException):
            return False
        status = exc.get_http_status_code()
        if status == 401:
            raise refused_login(self.uri) from None
        if status == 403:
            who = os.environ.get(USERNAME_ENV) or "this client"
            raise UserError(
                f"tracking store {self.uri} refused to let '{who}' {self.action} (HTTP 403): "
                "its owner can grant the rights, or choose another name"
            ) from None
        if self.missing and status in (400, 404):
            raise UserError(f"{self.missing} ({exc.message})") from None
        if status == 400:
            raise UserError(f"tracking store {self.uri}: {exc.message}") from None
        return False
