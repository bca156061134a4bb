"""`raytrain-lm cluster up|down`: cluster/local.yaml on one machine, a local autoscaling Ray
whose worker nodes are fake (raylets advertising the resources of cloud node types, fake GPUs
included), with token auth on and the dashboard on localhost.

`ray up` cannot start Ray's fake_multinode provider from the wheel (its example files are
missing), and `ray stop` stops every Ray on the machine. So `up` runs
`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` with its own temp dir and free
ports, and `down` ends exactly the processes that belong to that temp dir (`_pids`: by their
command line or their environment). The autoscaler starts fake nodes through
`fake_nodes.FakeNodeProvider`, each with a temp dir under the cluster's own. Beside the head
runs the team's MLflow server (tracking_server.py), as on the cloud configs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_lm.clusters import tracking_server
from raytrain_lm.errors import UserError
from raytrain_lm.placement import CPU_NODE, CPU_NODES_ENV
from raytrain_lm.runtime import free_port

DEFAULT_CONFIG = "cluster/local.yaml"
DEFAULT_DIR = "/tmp/raytrain-lm-cluster"
STATE_FILE = "cluster.json"
PROVIDER = "raytrain_lm.clusters.fake_nodes.FakeNodeProvider"
# The provider config key for the directory holding every fake node's temp dir.
NODE_DIRS_KEY = "node_dirs"
# Unix socket paths are limited to 107 bytes; Ray puts sockets at
# <node temp dir>/session_<date>_<pid>/sockets/plasma_store (about 65 bytes more), and a fake
# node's temp dir is <dir>/n<number>.
MAX_DIR_CHARS = 36
# Set by `up` for `ray start`, so every process of the cluster inherits it. Ray's client server
# (`ray.util.client.server`) names no directory on its command line, and its parent, `ray
# start`, has exited by the time `down` looks: this variable is how `down` knows it.
CLUSTER_ENV = "RAYTRAIN_LM_CLUSTER_DIR"


def _ray_executable() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


@dataclass(frozen=True)
class TrackingSetup:
    """Where the local cluster's MLflow server keeps its records, and its port: both the same
    from one `cluster up` to the next, since every run records the address it logged to."""

    home: str = tracking_server.DEFAULT_HOME
    port: int = tracking_server.DEFAULT_PORT


def read_state(directory: str | Path = DEFAULT_DIR) -> dict[str, Any] | None:
    path = Path(directory) / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def ensure_token() -> None:
    """Token auth needs ~/.ray/auth_token (or RAY_AUTH_TOKEN); make one if there is none."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    subprocess.run(
        [_ray_executable(), "get-auth-token", "--generate"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def resolved_config(config: str | Path, gcs_address: str, directory: Path) -> dict[str, Any]:
    path = Path(config)
    if not path.is_file():
        raise UserError(f"cluster config not found: {config}")
    tree = yaml.safe_load(path.read_text())
    if not isinstance(tree, dict) or tree.get("provider", {}).get("module") != PROVIDER:
        raise UserError(
            f"{config}: `cluster up` runs configs whose provider is {PROVIDER} only (see docs)"
        )
    # Without it the provider would start fake nodes against port 6379, which another Ray on
    # this machine may hold.
    tree["provider"]["gcs_address"] = gcs_address
    tree["provider"][NODE_DIRS_KEY] = str(directory)
    return tree


def offers_cpu_nodes(tree: dict[str, Any]) -> bool:
    """Whether some worker type carries the CPU-node marker, so CPU-only runs can go there."""
    return any(
        spec.get("resources", {}).get(CPU_NODE)
        for name, spec in tree["available_node_types"].items()
        if name != tree["head_node_type"]
    )


def up(
    config: str | Path = DEFAULT_CONFIG,
    directory: str | Path = DEFAULT_DIR,
    dashboard: bool = True,
    timeout_s: float = 120.0,
    tracking: TrackingSetup | None = TrackingSetup(),
) -> dict[str, Any]:
    """Starts the head of a local autoscaling cluster and, unless `tracking` is None, the
    team's MLflow server beside it; returns its state (address, dashboard, tracking)."""
    directory = Path(directory).resolve()
    if len(str(directory)) > MAX_DIR_CHARS:
        raise UserError(
            f"--dir {directory} is too long for Ray's socket paths; use at most "
            f"{MAX_DIR_CHARS} characters, e.g. {DEFAULT_DIR}"
        )
    running = read_state(directory)
    if running and _pids(directory):
        raise UserError(
            f"a local cluster already runs from {directory} at {running['address']}; "
            f"`raytrain-lm cluster down --dir {directory}` first"
        )
    directory.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    port, dash_port = free_port(), free_port()
    address = f"{host}:{port}"
    tree = resolved_config(config, address, directory)
    autoscaling = directory / "autoscaling.yaml"
    autoscaling.write_text(yaml.safe_dump(tree, sort_keys=False))
    ensure_token()
    # Under --no-tracking, nothing of a shell that logged in to a server earlier: jobs then log
    # to sqlite files, not to a server that is gone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env[CLUSTER_ENV] = str(directory)
    server = None
    if tracking is not None:
        server = tracking_server.start(
            tracking.home, host, tracking.port, directory / "tracking.log", env
        )
    try:
        env.update(tracking_server.ray_env(server) if server else {})
        _start_head(tree, directory, host, port, dash_port, dashboard, autoscaling, env)
        state = {
            "address": address,
            "dashboard": f"http://{host}:{dash_port}" if dashboard else None,
            "dir": str(directory),
            "config": str(Path(config).resolve()),
            "started": time.time(),
            "tracking": server,
        }
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))
        _wait_for_gcs(host, port, timeout_s)
    except BaseException:  # Ctrl-C included: nothing of this cluster stays up
        if server:
            tracking_server.stop(server["pid"])
        _kill(directory)
        (directory / STATE_FILE).unlink(missing_ok=True)
        raise
    return state


def _start_head(tree, directory, host, port, dash_port, dashboard, autoscaling, env) -> None:
    """`ray start --head` with the cluster's env; its failure is a UserError naming its log."""
    head_cpus = tree["available_node_types"][tree["head_node_type"]]["resources"].get("CPU", 1)
    env = {
        **env,
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_AUTH_MODE": "token",
        # Job entrypoints run `python`: the one this package is installed in.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # This cluster's own API server, never one inherited from another Ray on the machine.
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dash_port}",
    }
    if offers_cpu_nodes(tree):
        env[CPU_NODES_ENV] = "1"  # job drivers run on the head and inherit it
    command = [
        _ray_executable(),
        "start",
        "--head",
        f"--node-ip-address={host}",
        f"--port={port}",
        f"--num-cpus={head_cpus}",
        "--num-gpus=0",
        f"--temp-dir={directory}",
        f"--autoscaling-config={autoscaling}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--include-dashboard={'true' if dashboard else 'false'}",
        # The Jobs API runs arbitrary code: only this machine may reach it.
        f"--dashboard-host={host}",
        f"--dashboard-port={dash_port}",
        "--disable-usage-stats",
    ]
    log = directory / "ray-start.log"
    with log.open("w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"ray start failed ({tail[0]}); full log: {log}")


def _wait_for_gcs(host: str, port: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    raise UserError(f"the head did not open {host}:{port} within {timeout_s:g} s")


def _pids(directory: Path) -> list[int]:
    """Processes of this cluster: those whose command line names `directory` (Ray's daemons
    name the session dir under it; fake nodes are raylets started the same way) or whose
    environment carries it in CLUSTER_ENV (the client server names neither), and their
    descendants (workers, agents and dashboard modules rename themselves `ray::...`, which
    overwrites the environment that /proc shows of them)."""
    import psutil

    marker = str(directory)
    children: dict[int, list[int]] = {}
    parents: dict[int, int] = {}
    found: set[int] = set()
    # Processes of other users, and those gone meanwhile, read as None.
    for process in psutil.process_iter(["pid", "ppid", "cmdline", "environ"]):
        info = process.info
        pid, ppid = info["pid"], info["ppid"] or 0
        children.setdefault(ppid, []).append(pid)
        parents[pid] = ppid
        named = marker in " ".join(info["cmdline"] or ())
        if named or (info["environ"] or {}).get(CLUSTER_ENV) == marker:
            found.add(pid)
    # Never this process nor what started it: `sh -c "raytrain-lm cluster down --dir X"` (a
    # script, ssh, make, `timeout`) names the directory on its command line too.
    ours, pid = set(), os.getpid()
    while pid and pid not in ours:
        ours.add(pid)
        pid = parents.get(pid, 0)
    found -= ours
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child not in ours:
                found.add(child)
                stack.append(child)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(directory: Path, grace_s: float = 10.0) -> int:
    pids = _pids(directory)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def down(directory: str | Path = DEFAULT_DIR) -> int:
    """Stops the cluster started from `directory`; returns how many processes it ended."""
    directory = Path(directory).resolve()
    state = read_state(directory)
    if state is None and not _pids(directory):
        raise UserError(f"no local cluster runs from {directory}")
    ended = 0
    server = (state or {}).get("tracking")
    if server and server["pid"] in _pids(directory):  # never a process that took its pid since
        # First and alone: it stops its database, which a SIGKILL below would leave to recover.
        tracking_server.stop(server["pid"])
        ended += 1
    # Fake nodes are started by the autoscaler after `up`: repeat until none is left.
    for _ in range(3):
        killed = _kill(directory)
        ended += killed
        if not killed:
            break
    (directory / STATE_FILE).unlink(missing_ok=True)
    return ended
