"""A Ray Train callback (runs in the controller) that timestamps failures for goodput."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from raytrain_lm.trainer.goodput import append_event


class FailureEvents(UserCallback):
    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        append_event(
            self.run_dir,
            "failure_detected",
            ranks=sorted(worker_exceptions),
            errors=sorted({type(e).__name__ for e in worker_exceptions.values()}),
        )
