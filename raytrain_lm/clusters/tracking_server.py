"""The local cluster's MLflow server: `cluster up` starts `raytrain-lm tracking serve` beside
its head, as the cloud configs' heads do (PostgreSQL, logins on, on the address the dashboard
listens on), and gives Ray its address and the admin's login in the environment, so jobs and
their workers log there without a setting. `cluster down` stops it before the rest, so its
database shuts down cleanly; its home (the records) stays for the next `cluster up`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raytrain_lm.config import TRACKING_URI_ENV
from raytrain_lm.errors import UserError
from raytrain_lm.tracking.server import READY_SAYS, READY_WAIT_S, ServerHome, read_login

# This machine's one store, the same home `raytrain-lm tracking serve` uses by default.
DEFAULT_HOME = "~/raytrain-lm/tracking"
DEFAULT_PORT = 5000
# Beyond the server's own bounded wait for /health: the CLI's imports on a loaded machine.
START_MARGIN_S = 60.0
STOP_WAIT_S = 60.0


def start(home: str | Path, host: str, port: int, log: Path, env: dict[str, str]) -> dict:
    """Starts the server in a session of its own (it outlives `cluster up`'s process) and
    waits until it says it is ready; a server that ends first is a UserError naming its log."""
    home_dir = ServerHome(Path(home).expanduser().resolve())
    _refuse_a_home_in_use(home_dir)
    command = [
        sys.executable, "-m", "raytrain_lm.cli", "tracking", "serve", "--home", str(home_dir.root),
        "--host", host, "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + READY_WAIT_S + START_MARGIN_S
    while READY_SAYS not in log.read_text():
        if server.poll() is not None:
            said = log.read_text().strip().splitlines()[-1:] or ["no output"]
            reason = said[0].removeprefix("raytrain-lm: error: ")
            raise UserError(
                f"the tracking server did not start: {reason} (log {log}); nothing else was "
                "started (a cluster already up: `raytrain-lm cluster down --dir` it; else "
                "another --tracking-port, or --no-tracking for none)"
            )
        if time.monotonic() > deadline:
            stop(server.pid)
            raise UserError(f"the tracking server was not ready in time (log {log})")
        time.sleep(0.5)
    return {
        "url": f"http://{host}:{port}",
        "pid": server.pid,
        "home": str(home_dir.root),
        "login": str(home_dir.admin_env),
        "log": str(log),
    }


def _refuse_a_home_in_use(home: ServerHome) -> None:
    """Another server on this home (a `tracking serve`, another local cluster's) shares its
    database, which this cluster's `down` would then stop under it."""
    marker = home.pgdata / "postmaster.pid"
    try:
        pid = int(marker.read_text().splitlines()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return  # no database running there (a stale marker of one that crashed included)
    raise UserError(
        f"the tracking home {home.root} is in use (its database runs, pid {pid}): stop the "
        "server using it, or give this cluster --tracking-home elsewhere (or --no-tracking)"
    )


def ray_env(server: dict[str, Any]) -> dict[str, str]:
    """What Ray's processes need to log there: its address and the admin's login."""
    login = read_login(Path(server["login"]))
    return {
        TRACKING_URI_ENV: server["url"],
        "MLFLOW_TRACKING_USERNAME": login["MLFLOW_TRACKING_USERNAME"],
        "MLFLOW_TRACKING_PASSWORD": login["MLFLOW_TRACKING_PASSWORD"],
    }


def stop(pid: int) -> None:
    """SIGTERM, which stops MLflow and then the database; waits for both."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        try:
            # Reaps it when this process started it; otherwise only asks whether it lives.
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
