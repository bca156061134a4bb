"""Ray worker nodes that share nothing with the driver but the network, as on a real cluster.

Each node is `ray start --block` in a mount namespace of its own (`unshare -m`, root only) in
which the folders the driver works in are hidden under empty tmpfs mounts: a run whose state
or data sits in one of those folders cannot be read there, exactly as on a cloud node that
never had the driver's disk. The node reaches Ray and the test bucket over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def can_isolate() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


class IsolatedNode:
    def __init__(
        self,
        address: str,
        hidden: list[Path],
        resources: dict[str, float],
        num_cpus: int = 1,
    ):
        self.address, self.hidden = address, hidden
        self.resources, self.num_cpus = resources, num_cpus
        self.process: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rtlm-iso-", dir="/tmp")  # short socket paths
        ray = Path(sys.executable).parent / "ray"
        mounts = [f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(h))}" for h in self.hidden]
        start = [
            str(ray),
            "start",
            f"--address={self.address}",
            "--block",
            f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps(self.resources)}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        script = "set -e; " + "; ".join([*mounts, "exec " + shlex.join(start)])
        self.log = Path(self.temp_dir, "node.log")
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=open(self.log, "wb"),  # noqa: SIM115 (lives as long as the node)
            stderr=subprocess.STDOUT,
            start_new_session=True,  # kill() ends the node's whole process group
        )

    def wait_until_joined(self, node_count: int, timeout: float = 180, attempts: int = 3) -> None:
        """Waits until Ray lists `node_count` live nodes (this one among them). A node whose
        Ray gives up while starting (a loaded 2-core machine can miss its fixed deadlines) is
        started again, as `multinode._start_node` does, up to `attempts` times."""
        import ray

        deadline = time.time() + timeout
        for attempt in range(1, attempts + 1):
            while sum(1 for n in ray.nodes() if n["Alive"]) < node_count:
                if self.process.poll() is not None:
                    break
                if time.time() > deadline:
                    raise TimeoutError(f"isolated node not up after {timeout} s")
                time.sleep(0.5)
            else:
                return
            failure = self.log.read_text()[-2000:]
            if attempt == attempts:
                raise RuntimeError(f"isolated node exited: {failure}")
            print(f"isolated node exited while starting; retrying ({attempt}/{attempts})")
            self.cleanup()
            self._start()

    def kill(self) -> None:
        """Ends the node at once, like a machine that vanished."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
