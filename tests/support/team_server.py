"""`raytrain-lm tracking serve` as a user starts it, in a home of its own, on one port for
its life: stopped and started again mid-test, it keeps its database, logins and address."""

from __future__ import annotations

import re
import select
import subprocess
import sys
from pathlib import Path

from raytrain_lm.runtime import free_port
from raytrain_lm.tracking.server import READY_SAYS, read_env_file
from support.jobs import env

READY_LINE = re.compile(rf"{READY_SAYS} (http://\S+)")


class TeamServer:
    def __init__(self, home: Path):
        self.home = home
        self.port = free_port()
        self.url: str | None = None
        self.said: list[str] = []
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "raytrain_lm.cli", "tracking", "serve",
                   "--home", str(self.home), "--port", str(self.port), "--workers", "1"]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
        )
        url = None
        while url is None and self.process.poll() is None:
            # Its own wait for /health is bounded (READY_WAIT_S); this only reads what it says.
            if select.select([self.process.stdout], [], [], 5)[0]:
                self.said.append(self.process.stdout.readline())
                found = READY_LINE.search(self.said[-1])
                url = found.group(1) if found else None
        assert url is not None, "".join(self.said)
        self.url = url

    def stop(self) -> None:
        """SIGTERM, as a user's Ctrl-C or a head's shutdown: MLflow, then its database."""
        self.process.terminate()
        assert self.process.wait(timeout=120) == 0
        self.process.stdout.close()
        self.process = None
        assert not (self.home / "postgres" / "postmaster.pid").exists()  # stopped cleanly

    def login(self, name: str = "admin") -> dict[str, str]:
        return read_env_file(self.home / f"{name}.env")
