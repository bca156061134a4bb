"""`raytrain-lm cluster down` ends the processes that name its directory, never the command
that asked (a shell, `timeout`, ssh or make name the directory on their command lines too)."""

from __future__ import annotations

import subprocess
import sys


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
