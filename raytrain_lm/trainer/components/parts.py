"""What the loop's components share, in one typed record: the worker's run as the loop builds
it (worker.py). Each component reads the parts it needs; none of them reaches the loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrain_lm.config import RunConfig
    from raytrain_lm.rundir import RunDir
    from raytrain_lm.tracking import Tracker
    from raytrain_lm.trainer.chaos import Pacer
    from raytrain_lm.trainer.components.cadence import Cadences
    from raytrain_lm.trainer.components.evaluation import Evaluator
    from raytrain_lm.trainer.components.journal import Journal
    from raytrain_lm.trainer.components.state import RunProgress
    from raytrain_lm.trainer.components.step import StepParts
    from raytrain_lm.trainer.components.trainee import Trainee
    from raytrain_lm.trainer.components.watchdog import StepWatchdog
    from raytrain_lm.trainer.ray_side import RaySide
    from raytrain_lm.trainer.spec import WorkerSpec


@dataclass
class LoopParts:
    spec: WorkerSpec
    ray: RaySide
    trainee: Trainee
    progress: RunProgress
    journal: Journal
    tracker: Tracker
    every: Cadences
    watchdog: StepWatchdog
    pacer: Pacer
    end_step: int
    # What the loop steps with (prepare): replica groups make them before they join
    step_parts: StepParts | None = None
    batches: Any = None  # the data stream: Iterator[(positions, tokens)], `close()`
    evaluate: Evaluator | None = None
    optimizer_state: Any = None  # what a checkpoint holds of the optimizers (the sync says)

    @property
    def cfg(self) -> RunConfig:
        return self.spec.config

    @property
    def run_dir(self) -> RunDir:
        return self.spec.run_dir

    @property
    def device(self) -> torch.device:
        return self.trainee.device

    def after_step(self, started: float) -> None:
        """Every step trained (a round's inner steps too): alive; paced in chaos tests."""
        self.watchdog.beat()
        self.pacer.pace(started)

    def restart_step_clock(self) -> None:
        """Time from here on is step time again (after an evaluation or a checkpoint)."""
        self.progress.pending.restart_clock()
        self.watchdog.beat()
