"""`raytrain-lm tracking serve`: the team's MLflow tracking server, as a cluster's head runs it.

MLflow's own server does the work: `mlflow server --app-name basic-auth` with its runs in a
PostgreSQL database and its artifacts in a bucket or a folder. This module only sets it up the
way a shared, long-lived store must be set up:

- The database is an embedded PostgreSQL (`pgserver`) in the server's home, reached through a
  Unix socket only (nothing listens on the network), unless $RAYTRAIN_LM_TRACKING_DATABASE_URI
  names one of the cloud's (RDS, Cloud SQL). The runs and the logins live in two databases.
- Logins are on. The admin's password is generated at the first start and written to
  `admin.env` (mode 0600, `KEY=VALUE` lines for `set -a; . FILE`), or, on a cluster, made
  where `ray up` runs (`raytrain-lm tracking login`) and mounted on every node beside Ray's
  token; it is never printed or logged, and MLflow reads it only to create the admin once.
- Files holding secrets (the admin's password, the Flask secret that signs the UI's forms)
  are made with mode 0600. (The home itself must stay traversable: run as root, pgserver
  runs PostgreSQL as a user of its own, which must reach the database folder.)

The server runs in the foreground until SIGTERM or Ctrl-C, then stops the database it started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from raytrain_lm.errors import UserError

ADMIN = "admin"
RUNS_DB, LOGINS_DB = "mlflow", "mlflow_auth"
READY_WAIT_S = 180.0  # an MLflow server imports for 10-20 s on a loaded 2-core head
PERMISSIONS = ("NO_PERMISSIONS", "READ", "USE", "EDIT", "MANAGE")
# Where the server keeps artifacts, as a cluster's login file can say (`tracking login`).
ARTIFACTS_ENV = "RAYTRAIN_LM_TRACKING_ARTIFACTS"
# A PostgreSQL of the cloud's (RDS, Cloud SQL) instead of the embedded one; holds its password.
DATABASE_ENV = "RAYTRAIN_LM_TRACKING_DATABASE_URI"
LOGIN_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# What the server says once it answers, which those who start it wait for.
READY_SAYS = "tracking server at"


@dataclass(frozen=True)
class ServerHome:
    """The server's files: database, artifacts (unless in a bucket), logins config, secrets."""

    root: Path

    @property
    def pgdata(self) -> Path:
        return self.root / "postgres"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def auth_config(self) -> Path:
        return self.root / "basic_auth.ini"

    @property
    def admin_env(self) -> Path:
        return self.root / "admin.env"

    @property
    def flask_secret(self) -> Path:
        return self.root / "flask_secret"

    @property
    def log(self) -> Path:
        return self.root / "server.log"


def write_secret(path: Path, text: str, *, replace: bool = True) -> None:
    """Creates `path` readable by its owner only, from the first byte (no umask window).
    `replace=False` is for logins, which are never replaced: an existing file is an error."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UserError(f"{path} exists: a login is never replaced (remove it first)") from None
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=VALUE` lines, as `admin.env` and `raytrain-lm tracking user` write them; or a
    folder with a file per key, as Kubernetes mounts a Secret made from such a file."""
    if path.is_dir():
        # Kubernetes keeps the real files in `..data/` and links each key beside it.
        keys = (item for item in path.iterdir() if not item.name.startswith("."))
        return {item.name: item.read_text().strip() for item in keys if item.is_file()}
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            values[key.strip()] = value.strip()
    return values


def new_admin_login(path: Path, artifacts: str | None = None) -> None:
    """Writes the admin's login, with a generated password, to `path` (mode 0600); with
    `artifacts`, also where the server keeps them. Refuses to replace a login."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The tracking server's admin (raytrain-lm tracking); keep this file private.",
        f"MLFLOW_TRACKING_USERNAME={ADMIN}",
        f"MLFLOW_TRACKING_PASSWORD={secrets.token_urlsafe(24)}",
    ]
    if artifacts:
        lines.append(f"{ARTIFACTS_ENV}={artifacts}")
    write_secret(path, "\n".join(lines) + "\n", replace=False)


def read_login(path: Path) -> dict[str, str]:
    """A login file's (or Secret folder's) values; one without a user name and password is a
    UserError naming what it lacks."""
    values = read_env_file(path)
    missing = [key for key in LOGIN_KEYS if not values.get(key)]
    if missing:
        raise UserError(
            f"login {path} lacks {' and '.join(missing)} (as `raytrain-lm tracking login` "
            "writes it; a Kubernetes Secret made from it with --from-env-file)"
        )
    return values


def _admin_password(login: Path) -> str:
    """The admin's password: from `login`, written there first if it does not exist."""
    if not login.exists():
        new_admin_login(login)
    return read_login(login)["MLFLOW_TRACKING_PASSWORD"]


def _flask_secret(home: ServerHome) -> str:
    if not home.flask_secret.exists():
        write_secret(home.flask_secret, secrets.token_hex(32))
    return home.flask_secret.read_text().strip()


def _with_driver(uri: str) -> str:
    """MLflow's PostgreSQL driver is psycopg 3 (a dependency): said in the URI, so an older
    SQLAlchemy, whose default for `postgresql://` is psycopg2, does not reach for that."""
    from sqlalchemy.engine import make_url

    return make_url(uri).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def _embedded_database(home: ServerHome):
    """An embedded PostgreSQL in `home`, with the two databases; its URIs use its socket."""
    import pgserver

    if home.pgdata.is_dir():
        # PostgreSQL refuses a data folder others may read; a volume mounted with a group
        # (Kubernetes' fsGroup) is widened at every mount.
        home.pgdata.chmod(0o700)
    server = pgserver.get_server(home.pgdata, cleanup_mode="stop")
    existing = {
        line.strip() for line in server.psql("SELECT datname FROM pg_database;").splitlines()
    }
    for name in {RUNS_DB, LOGINS_DB} - existing:
        server.psql(f"CREATE DATABASE {name};")
    return server, _with_driver(server.get_uri(RUNS_DB)), _with_driver(server.get_uri(LOGINS_DB))


def _write_auth_config(home: ServerHome, logins_uri: str, default_permission: str) -> None:
    write_secret(
        home.auth_config,
        "[mlflow]\n"
        f"default_permission = {default_permission}\n"
        # configparser's interpolation reads `%`: a URL-encoded password must say `%%`
        f"database_uri = {logins_uri.replace('%', '%%')}\n"
        f"admin_username = {ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )


def _database_uris(home: ServerHome):
    """(embedded server or None, runs URI, logins URI). A database of the cloud's is named by
    DATABASE_ENV (it holds its password: never on a command line); the logins go in a
    database of the same server named LOGINS_DB."""
    given = os.environ.get(DATABASE_ENV)
    if not given:
        return _embedded_database(home)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(given)
    except ArgumentError:
        raise UserError(f"${DATABASE_ENV} is not a database URI") from None
    if url.get_backend_name() != "postgresql":
        raise UserError(f"${DATABASE_ENV}: expected postgresql://..., got {url.drivername}://...")
    runs = url.set(drivername="postgresql+psycopg")
    return (
        None,
        runs.render_as_string(hide_password=False),
        runs.set(database=LOGINS_DB).render_as_string(hide_password=False),
    )


def _check_port_free(host: str, port: int) -> None:
    """A server still on the port (one being restarted) would answer our readiness check."""
    with socket.socket() as probe:
        # As the server binds: connections of a server that just stopped, still in TIME_WAIT,
        # do not hold the port; a server listening on it still does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _check_admin_login(url: str, login: Path) -> None:
    """MLflow creates the admin once, from the first password it is given: a login file made
    later (lost and made again, or another cluster's) would lock every run out."""
    import requests

    values = read_login(login)
    auth = (values["MLFLOW_TRACKING_USERNAME"], values["MLFLOW_TRACKING_PASSWORD"])
    answer = requests.get(f"{url}/api/2.0/mlflow/users/current", auth=auth, timeout=20)
    if answer.status_code == 401:
        raise UserError(
            f"the admin login in {login} is not this server's admin (its database was set up "
            "with another password): use that login file, or reset the admin's password "
            "(docs/tracking.md)"
        )


def serve(
    home: Path,
    host: str = "127.0.0.1",
    port: int = 5000,
    artifacts: str | None = None,
    default_permission: str = "READ",
    workers: int = 2,
    admin_login: Path | None = None,
) -> int:
    """Starts the server and returns its exit status once it ends. The admin's login is
    `admin_login` (a cluster's, made where `ray up` runs), else HOME/admin.env, generated at
    the first start; artifacts go to `artifacts`, else where that file says, else HOME."""
    if default_permission not in PERMISSIONS:
        raise UserError(f"--default-permission {default_permission}: one of {PERMISSIONS}")
    home = ServerHome(Path(home).expanduser().resolve())
    home.root.mkdir(parents=True, exist_ok=True)
    _check_port_free(host, port)
    running: dict[str, subprocess.Popen] = {}
    asked_to_stop = []

    def stop(*_) -> None:
        asked_to_stop.append(True)
        if "mlflow" in running:
            running["mlflow"].terminate()

    # From before the database starts: a stop while starting still stops what has started.
    signal.signal(signal.SIGTERM, stop)
    database = None
    try:
        database, runs_uri, logins_uri = _database_uris(home)
        _write_auth_config(home, logins_uri, default_permission)
        login = Path(admin_login).expanduser() if admin_login else home.admin_env
        env = _server_env(home, runs_uri, _admin_password(login))
        destination = artifacts or read_env_file(login).get(ARTIFACTS_ENV) or str(home.artifacts)
        command = [
            sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
            "--artifacts-destination", destination,
            "--host", host, "--port", str(port), "--workers", str(workers),
        ]  # fmt: skip
        with open(home.log, "a") as log:
            running["mlflow"] = server = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        if asked_to_stop:  # while the database started: MLflow ends at once, then it
            server.terminate()
        url = f"http://{host}:{port}"
        wait_ready(url, server, home.log)
        _check_admin_login(url, login)
        print(f"[raytrain-lm] {READY_SAYS} {url} (logins on; the admin's in {login}; "
              f"artifacts in {destination}; log {home.log})", flush=True)  # fmt: skip
        code = server.wait()
        return 0 if asked_to_stop else code
    except KeyboardInterrupt:
        stop()
        return 0
    except UserError:
        if asked_to_stop:  # stopped while starting: not a failure
            return 0
        raise
    finally:
        _shut_down(running.get("mlflow"), database)


def _shut_down(mlflow: subprocess.Popen | None, database) -> None:
    """MLflow first (asked already, killed if it lingers), then the database it used."""
    if mlflow is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            mlflow.wait(timeout=30)
        if mlflow.poll() is None:
            mlflow.kill()
    if database is not None:
        database.cleanup()


def _server_env(home: ServerHome, runs_uri: str, password: str) -> dict[str, str]:
    return {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(home.auth_config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": _flask_secret(home),
        "MLFLOW_BACKEND_STORE_URI": runs_uri,  # not a command-line argument: it may hold a password
        # MLflow's server-side job runner serves none of our uses, and its worker processes
        # cost a small head more CPU than the server itself.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get(
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"
        ),
    }


def wait_ready(url: str, server: subprocess.Popen, log: Path) -> None:
    """Waits for `/health`; a server that exits first is an error naming its log."""
    import requests

    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text().strip().splitlines()[-1:] or ["(empty log)"]
            raise UserError(f"tracking server exited ({server.returncode}): {tail[0]} ({log})")
        try:
            if requests.get(f"{url}/health", timeout=2).ok and server.poll() is None:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    server.terminate()
    raise UserError(f"tracking server not ready after {READY_WAIT_S:.0f} s (log {log})")
