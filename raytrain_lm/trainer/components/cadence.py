"""When the loop's periodic work happens: every N steps, every S seconds, and at the end.

The loop declares its cadences in one table (log, eval, checkpoint, signal check, heartbeat)
instead of testing counters inline, so when each thing happens can be read in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raytrain_lm.config import RunConfig

HEARTBEAT_EVERY_S = 0.5


@dataclass
class Every:
    """Due every `steps` optimizer steps, every `seconds` of wall time (by this process's
    clock), and/or at the last step of the invocation."""

    steps: int | None = None
    seconds: float | None = None
    at_end: bool = False
    since: int = 0  # steps count from this step (an interval changed there)
    # Steps that advance several at a time (DiLoCo's rounds): due once a multiple was passed.
    crossing: bool = False
    _last_time: float = field(default_factory=time.monotonic, repr=False)
    _last_step: int | None = field(default=None, repr=False)
    last_due: bool = field(default=False, repr=False)

    def due(self, step: int, end_step: int) -> bool:
        self.last_due = self._due(step, end_step)  # what this step was told
        return self.last_due

    def _due(self, step: int, end_step: int) -> bool:
        last, self._last_step = self._last_step, step
        if self.at_end and step == end_step:
            return True
        if self.steps is not None:
            if self.crossing and last is not None:
                if (step - self.since) // self.steps > (last - self.since) // self.steps:
                    return True
            elif (step - self.since) % self.steps == 0:
                return True
        if self.seconds is not None and time.monotonic() - self._last_time >= self.seconds:
            self._last_time = time.monotonic()
            return True
        return False

    def count_every(self, steps: int, since: int) -> None:
        """Due every `steps` from step `since` on (checkpoint.every_steps=auto chose anew)."""
        self.steps, self.since = steps, since

    def count_from(self, step: int) -> None:
        """A cadence that crosses multiples counts from `step` (a group joined there)."""
        self._last_step = step


@dataclass(frozen=True)
class Reads:
    """What a step reads: its metrics for the log, the validation loss, a checkpoint."""

    log: bool
    eval: bool
    checkpoint: bool

    @property
    def any(self) -> bool:
        return self.log or self.eval or self.checkpoint


@dataclass(frozen=True)
class Flags:
    ask: bool  # rank 0's clock says: ask Ray whether one of our nodes is being drained
    stop: bool  # the driver asked the run to stop

    @property
    def raised(self) -> bool:
        return self.ask or self.stop


@dataclass(frozen=True)
class Cadences:
    """When each periodic part of the loop runs: all of them, in one place."""

    heartbeat: Every  # rank 0's liveness record for goodput (seconds)
    signals: Every  # rank 0 looks for a stop request and asks about preemption (seconds)
    log: Every  # progress line and live goodput metrics (steps); step metrics: every step
    eval: Every  # validation loss (steps, and the last step)
    checkpoint: Every  # checkpoint + report to Ray Train (steps, and the last step)

    @classmethod
    def of(cls, cfg: RunConfig) -> Cadences:
        return cls(
            heartbeat=Every(seconds=HEARTBEAT_EVERY_S),
            signals=Every(seconds=cfg.fault.preemption_check_s),
            log=Every(steps=cfg.training.log_every, at_end=True),
            eval=Every(steps=cfg.training.eval_every, at_end=True),
            checkpoint=Every(steps=first_checkpoint_interval(cfg), at_end=True),
        )

    def reads(self, step: int, end_step: int) -> Reads:
        """Which of the reads are due at `step` (each cadence asked once per step)."""
        log = self.log.due(step, end_step)
        evaluate = self.eval.due(step, end_step)
        return Reads(log, evaluate, self.checkpoint.due(step, end_step))


def first_checkpoint_interval(cfg: RunConfig) -> int:
    """checkpoint.every_steps; under `auto`, a first checkpoint early enough to measure its
    cost (a quarter of the run, at most 100 steps), after which the loop sets the interval."""
    every = cfg.checkpoint.every_steps
    return every if every != "auto" else max(1, min(100, cfg.training.max_steps // 4))
