"""What a tracking store's address and its errors tell a tracker: that MLflow's own retries
must give way to ours, that a local store cannot exist, that retrying cannot fix an error."""

from __future__ import annotations

import os
from pathlib import Path

from raytrain_lm.errors import UserError

# MLflow's client reads a login from these; so do we, never from a config or command line.
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


def retry_on_our_schedule(uri: str) -> None:
    if uri.startswith(("http://", "https://")):
        # We retry on our own schedule (a background thread, or the wait to open a run);
        # MLflow's default of 7 retries with exponential backoff holds each call for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def check_local_store(uri: str) -> None:
    """A local store that cannot exist is not an outage to wait for: refuse it at once."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
        if path.name != ":memory:" and not path.parent.is_dir():
            raise UserError(f"tracking store {uri}: folder {path.parent} does not exist")


def is_permanent(exc: Exception) -> bool:
    """Errors that retrying cannot fix (a deleted run, a malformed value): drop, don't loop."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.get_http_status_code() in (400, 404)


def refused_login(uri: str) -> UserError:
    who = os.environ.get(USERNAME_ENV)
    said = f"the login of '{who}'" if who else "a client without a login"
    return UserError(
        f"tracking store {uri} refused {said} (HTTP 401): set {USERNAME_ENV} and "
        f"{PASSWORD_ENV} in the environment (docs/tracking.md)"
    )


def refusal(exc: Exception, uri: str, experiment: str) -> UserError | None:
    """A server with logins that refused the environment's login (401) or its rights on
    `experiment` (403), said in one line; else None."""
    from mlflow.exceptions import MlflowException

    status = exc.get_http_status_code() if isinstance(exc, MlflowException) else None
    if status == 401:
        return refused_login(uri)
    if status == 403:
        return UserError(
            f"tracking store {uri} refused to log to experiment '{experiment}' (HTTP 403): "
            "its owner can give you EDIT rights, or set tracking.experiment to another"
        )
    return None
