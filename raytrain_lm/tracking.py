"""Experiment tracking behind one small interface. MLflow is the implementation; only the
driver and rank 0 ever hold a live tracker, every other rank gets `NullTracker`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from raytrain_lm.config import TrackingConfig

DEFAULT_DB = "mlflow.db"


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    run_id = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


def resolve_tracking_uri(cfg: TrackingConfig, base_dir: str | Path = ".") -> str:
    """Config, then $MLFLOW_TRACKING_URI, then an embedded sqlite file in `base_dir`."""
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(base_dir).resolve() / DEFAULT_DB}"


class MLflowTracker:
    """Buffers per-step metrics and writes them in batches so logging never stalls a step."""

    def __init__(self, uri: str, run_id: str, flush_every: int = 50):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.run_id = uri, run_id
        self._pending: list = []
        self._in_flight: list = []  # asynchronous MLflow writes not yet confirmed
        self._flush_every = flush_every

    @classmethod
    def start(cls, uri: str, experiment: str, run_name: str, run_id: str | None) -> MLflowTracker:
        """Opens `run_id` again when given (a resumed run), else creates a new MLflow run."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            try:
                client.update_run(run_id, status="RUNNING")
                return cls(uri, run_id)
            except Exception:  # the store was reset: start afresh rather than fail the run
                pass
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=run_name)
        return cls(uri, run.info.run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            try:
                self.client.log_batch(self.run_id, params=items[i : i + 100])
            except Exception as exc:  # same keys logged by an earlier attempt of this run
                if "already logged" not in str(exc) and "Changing param" not in str(exc):
                    raise

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if len(self._pending) >= self._flush_every * max(1, len(metrics)):
            self._send(synchronous=False)  # written by MLflow's background thread

    def _send(self, synchronous: bool) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:1000], self._pending[1000:]
            operation = self.client.log_batch(self.run_id, metrics=chunk, synchronous=synchronous)
            if operation is not None:
                self._in_flight.append(operation)

    def flush(self) -> None:
        """Blocks until every metric logged so far is stored."""
        self._send(synchronous=True)
        for operation in self._in_flight:
            operation.wait()
        self._in_flight.clear()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
