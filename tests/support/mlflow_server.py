"""A real MLflow tracking server (sqlite backend, 127.0.0.1) for tests, stoppable mid-test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from raytrain_lm.runtime import free_port


class MlflowServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 240.0) -> None:
        mlflow = Path(sys.executable).parent / "mlflow"
        command = [
            str(mlflow),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 (lives as long as the server)
        # No job runner: its worker processes (MLflow's server-side jobs, which no test uses)
        # cost more CPU than the server itself on this 2-core machine.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(
            command, cwd=self.root, stdout=log, stderr=log, start_new_session=True, env=env
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.root / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server on {self.uri} not ready after {timeout} s")

    def stop(self) -> None:
        if self.process is None:
            return
        # the server's own process group: gunicorn/uvicorn workers go with it
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
