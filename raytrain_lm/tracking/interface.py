"""What training logs through (`Tracker`), and the tracker of a rank that logs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raytrain_lm.tracking.models import CheckpointModel


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str | None = "FINISHED") -> None: ...
    @property
    def stored_through(self) -> int: ...
    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None: ...
    def log_checkpoint(self, model: CheckpointModel) -> None: ...


class NullTracker:
    run_id = None
    stored_through = 2**62  # nothing is kept for a store there is not

    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_checkpoint(self, model: CheckpointModel) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str | None = "FINISHED") -> None:
        pass
