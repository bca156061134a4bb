"""Replica groups' chief: every group holds a tracker and a progress line, and only the
current chief's calls go out (the lowest place in the latest quorum; it changes when groups
come and go)."""

from __future__ import annotations

from collections.abc import Callable

from raytrain_lm.rundir import RunDir
from raytrain_lm.tracking import Tracker
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.progress import ProgressBar

Kept = list[tuple[int, dict[str, float]]]  # (step, metrics)


class ChiefTracker:
    """What the chief logged its tracker stores in the background, so a chief that dies takes
    its unsent metrics with it. Every group therefore keeps what it would have logged until the
    chief says, in a step's sums, that its store holds it (`confirm`); a group that becomes
    chief logs what it kept where the store lacks it (`MLflowTracker.log_missing`): each step
    once, whoever logged it."""

    def __init__(
        self, tracker: Tracker, speaks: Callable[[], bool], fault: chaos.Fault | None, run_dir
    ):
        self.tracker, self.speaks, self.fault, self.run_dir = tracker, speaks, fault, run_dir
        self.kept: list[tuple[int, dict[str, float], bool]] = []  # (step, metrics, logged)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        speaks = self.speaks()
        if speaks:
            unlogged = [(s, m) for s, m, logged in self.kept if not logged]
            if unlogged:  # another chief's steps: the store may lack some
                self.tracker.log_missing(unlogged)
                self.kept = [(s, m, True) for s, m, _ in self.kept]
            self.tracker.log_metrics(metrics, step=step)
            chaos.maybe_kill_chief(self.fault, RunDir.coerce(self.run_dir), step)
        self.kept.append((step, metrics, speaks))

    @property
    def stored_through(self) -> int:
        """What this group, as chief, tells the others its store holds (-1: nothing)."""
        return self.tracker.stored_through

    def confirm(self, stored_through: int) -> None:
        """The chief's store holds every step up to `stored_through`: forget them."""
        self.kept = [row for row in self.kept if row[0] > stored_through]

    def handover(self) -> Kept:
        """What a group healing from this one keeps in its place (not logged by it)."""
        return [(step, metrics) for step, metrics, _ in self.kept]

    def adopt(self, kept: Kept) -> None:
        self.kept = [(step, metrics, False) for step, metrics in kept]

    def log_missing(self, steps: Kept) -> None:
        self.tracker.log_missing(steps)

    def log_checkpoint(self, model) -> None:
        """The chief uploads checkpoints, so it logs them (idempotent per checkpoint: models.py)."""
        if self.speaks():
            self.tracker.log_checkpoint(model)

    def flush(self) -> None:
        self.tracker.flush()


class ChiefProgress(ProgressBar):
    def __init__(self, speaks: Callable[[], bool], *args):
        super().__init__(*args)
        self.speaks = speaks

    def update(self, step: int, metrics: dict[str, float], force: bool = False) -> None:
        if self.speaks():
            super().update(step, metrics, force)
