"""`raytrain-lm cluster down` ends the processes of its cluster: those that name its directory,
and those that carry it in their environment (Ray's client server names none), never the
command that asked (a shell, `timeout`, ssh or make name the directory on their command lines
too). A whole `cluster up`/`down` leaving no process behind: tests/test_jobs.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
from support.jobs import cli

from raytrain_lm.clusters.autoscaling import CLUSTER_ENV, _pids


def test_cluster_down_spares_the_processes_that_started_it(tmp_path):
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    # A daemon of that cluster: its command line names the directory, as Ray's do.
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", str(cluster / "session")]
    )
    try:
        finder = (
            "from pathlib import Path; from raytrain_lm.clusters.autoscaling import _pids; "
            f"print(_pids(Path({str(cluster)!r})))"
        )
        # The shell that runs the finder names the directory too (a comment, here).
        shell = f"{sys.executable} -c {finder!r}; : {cluster}"
        found = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, check=True)
        assert eval(found.stdout) == [daemon.pid], found
    finally:
        daemon.kill()
        daemon.wait()


# Starts a sleeper and exits at once, as `ray start` leaves Ray's client server behind (the
# sleeper's output elsewhere: a pipe it held open would keep the caller waiting for it).
ORPHANING = (
    "import subprocess as s, sys; print(s.Popen([sys.executable, '-c', 'import time; "
    "time.sleep(120)'], stdin=s.DEVNULL, stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
)


def test_cluster_down_finds_an_orphan_that_names_nothing(tmp_path):
    """Ray's client server (`python -m ray.util.client.server --address=... --port=...`)
    names no directory, and its parent has exited: `up`'s environment says whose it is."""
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    env = {**os.environ, CLUSTER_ENV: str(cluster)}
    started = subprocess.run(
        [sys.executable, "-c", ORPHANING], env=env, capture_output=True, text=True, check=True
    )
    orphan = int(started.stdout)
    try:
        assert psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE  # running, an orphan
        assert _pids(cluster) == [orphan]
        assert _pids(tmp_path / "another") == []
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_cluster_up_with_its_tracking_port_taken_says_so_and_starts_nothing(tmp_path):
    directory = Path(tempfile.mkdtemp(prefix="rtlm-", dir="/tmp"))  # short: Ray's socket paths
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = cli("cluster", "up", "--dir", str(directory), "--tracking-home",
                 str(tmp_path / "tracking"), "--tracking-port", str(port))  # fmt: skip
    assert up.returncode == 2, up.stderr[-2000:]
    (line,) = up.stderr.strip().splitlines()
    assert line.startswith("raytrain-lm: error: the tracking server did not start: cannot "
                           f"listen on 127.0.0.1:{port}: Address already in use")  # fmt: skip
    assert "another --tracking-port, or --no-tracking" in line
    assert _pids(directory) == [] and not (directory / "cluster.json").exists()
    shutil.rmtree(directory)
