"""Who may log where, on a tracking server with logins (MLflow's basic-auth app).

Clients log in with `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD` from their
environment, as MLflow's client reads them: never from a config file or a command line, so a
run's config, params and audit records cannot carry them.

- `check_can_log`: before a run starts anything, a refused login, or a user who may read but
  not edit the run's experiment, is one line naming the experiment (a `UserError`).
- `grant`: the admin's side: a user (created with a generated password, written to a file
  only its owner reads) and their rights on one experiment.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from raytrain_lm.errors import UserError
from raytrain_lm.tracking.store import (
    PASSWORD_ENV,
    USERNAME_ENV,
    refused_login,
    retry_on_our_schedule,
)

CAN_LOG = ("EDIT", "MANAGE")
TIMEOUT_S = 20


def _credentials() -> tuple[str, str] | None:
    user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password else None


def check_can_log(uri: str, experiment: str) -> None:
    """Raises a `UserError` when the server refuses the environment's login, or when its user
    may not create runs in `experiment`. A local store, a server without logins, a new
    experiment (its creator manages it) and a server that does not answer (the run's start
    waits for it: wait.py) pass."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    # MLflow's own client side: its login, token and TLS settings, one try (no retries).
    creds = get_default_host_creds(uri)

    def get(endpoint: str, **params) -> requests.Response:
        return http_request(
            creds, endpoint, "GET", max_retries=0, timeout=TIMEOUT_S, params=params,
            raise_on_status=False,
        )  # fmt: skip

    try:
        found = get("/api/2.0/mlflow/experiments/get-by-name", experiment_name=experiment)
        if found.status_code == 401:
            raise refused_login(uri)
        if found.status_code == 403:
            raise UserError(
                f"tracking store {uri}: the login of '{os.environ.get(USERNAME_ENV)}' may not "
                f"read experiment '{experiment}', and a run needs EDIT; ask its owner for them"
            )
        if found.status_code != 200:
            return  # no such experiment yet: whoever creates it manages it
        experiment_id = found.json()["experiment"]["experiment_id"]
        current = get("/api/2.0/mlflow/users/current")
        if current.status_code != 200:
            return  # a server without logins
        user = current.json()["user"]
        if user["is_admin"]:
            return
        rights = get(
            "/api/3.0/mlflow/users/permissions/get",
            username=user["username"],
            resource_type="experiment",
            resource_id=experiment_id,
        )
        permission = rights.json().get("permission") if rights.status_code == 200 else None
    except (requests.RequestException, MlflowException, ValueError, KeyError):
        return  # unreachable or not MLflow's answer: opening the run says what is wrong
    if permission is not None and permission not in CAN_LOG:
        raise UserError(
            f"tracking store {uri}: user '{user['username']}' has {permission} rights on "
            f"experiment '{experiment}', and a run needs EDIT; ask its owner for them "
            f"(raytrain-lm tracking user {user['username']} --experiment {experiment} "
            "--permission EDIT) or set tracking.experiment to another experiment"
        )


def grant(
    uri: str, username: str, experiment: str, permission: str, credentials_dir: Path
) -> Path | None:
    """As the admin (the environment's login): creates `username` if new, with a generated
    password written to `credentials_dir/<username>.env`, and gives them `permission` on
    `experiment` (created if missing). Returns the new credentials file, or None for a user
    who existed."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client
    from mlflow.tracking import MlflowClient

    from raytrain_lm.tracking.server import write_secret

    if _credentials() is None:
        raise UserError(f"set {USERNAME_ENV} and {PASSWORD_ENV} to the admin's login first")
    retry_on_our_schedule(uri)
    admin = get_app_client("basic-auth", tracking_uri=uri)
    written = None
    try:
        if not _user_exists(admin, username, uri):
            # The login is on disk before the user exists: a password nobody kept is useless.
            credentials_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            written = credentials_dir / f"{username}.env"
            password = secrets.token_urlsafe(18)
            login = f"{USERNAME_ENV}={username}\n{PASSWORD_ENV}={password}\n"
            write_secret(written, login, replace=False)
            try:
                admin.create_user(username, password)
            except BaseException:
                written.unlink()
                raise
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        try:
            admin.grant_user_permission(username, "experiment", experiment_id, permission)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            # MLflow's client has no update of a user's grant: replaced, which leaves the
            # user with the server's default rights for the moment between the two calls.
            admin.revoke_user_permission(username, "experiment", experiment_id)
            admin.grant_user_permission(username, "experiment", experiment_id, permission)
    except UserError:
        raise
    except MlflowException as exc:
        raise UserError(f"tracking store {uri}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # the store unreachable: requests' and urllib3's long texts
        raise UserError(f"tracking store {uri} unreachable ({type(exc).__name__})") from None
    return written


def _user_exists(admin, username: str, uri: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        admin.get_user(username)
        return True
    except MlflowException as exc:
        status = exc.get_http_status_code()
        if status == 401:
            raise refused_login(uri) from None
        if status == 403:
            raise UserError(f"only the tracking server's admin may manage users ({uri})") from None
        if status != 404:
            raise
        return False
