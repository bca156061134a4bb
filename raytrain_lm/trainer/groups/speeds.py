"""`scaling.balance=auto` with replica groups: shares by each group's own measured speed.

A static group times its ranks together and re-plans at a checkpoint (rebalancing.py). The
participants of replica groups change from one step to the next, so each group keeps a figure
of its own instead: it times its forward passes (balance.ForwardClock: a forward holds no
collective, so it times this device alone) over MEASURE_STEPS steps after a warm-up, and
declares the sequences per second it measured. It declares again only when a later window
differs from its declaration by more than `scaling.balance_tolerance`, so that noise moves no
share (on a GPU a new share is a new shape to compile).

Before each step the participants sum their declarations in one small vector (as type weights
are summed: replica_step.py), and every participant derives the same shares from the same sum.
A group that has not measured yet (it just started, joined or changed share) counts at the mean
of those that have; with no declaration at all the shares are equal. A change of this group's
share starts a new warm-up: the first passes of a new shape compile, and are not its pace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from raytrain_lm.trainer.components.balance import MEASURE_STEPS, MIN_SEQUENCES, ForwardClock
from raytrain_lm.trainer.components.pending_values import WARMUP_STEPS


class DeclaredSpeed:
    """This group's measured sequences per second of forward, as it declares it to the others."""

    def __init__(self, clock: ForwardClock, tolerance: float):
        self.clock, self.tolerance = clock, tolerance
        self.declared: float | None = None
        self.share: int | None = None  # this group's share in the plan last agreed
        self.warm_until = 0  # the first step whose forwards count
        self.window_from: int | None = None  # the step the current window began at

    def before_step(self, step: int) -> None:
        """Closes a measuring window that is due. Called as a step begins: the host has waited
        for the device at the last step's sums, so reading the clock waits for nothing."""
        if step < self.warm_until:
            return
        if self.window_from is None:
            self.clock.take()  # the warm-up's forwards
            self.window_from = step
            return
        if step - self.window_from < MEASURE_STEPS:
            return
        seconds, sequences = self.clock.take()
        self.window_from = step
        if sequences < MIN_SEQUENCES or seconds <= 0:
            return
        measured = sequences / seconds
        if self.declared is None or abs(measured / self.declared - 1.0) > self.tolerance:
            self.declared = measured

    def agreed_share(self, step: int, share: int) -> None:
        """This group's share in the step's plan: a new one is measured anew, after a warm-up."""
        if share != self.share:
            self.share = share
            self.warm_until, self.window_from = step + WARMUP_STEPS, None

    def slots(self, place: int, participants: int, group: int) -> list[float]:
        """This group's part of the vector the participants sum: its declared speed at its
        place, at `participants + place` whether it has declared one, and at
        `2 * participants + place` its group's index + 1 (who the places are)."""
        vector = [0.0] * (3 * participants)
        vector[2 * participants + place] = group + 1.0
        if self.declared is not None:
            vector[place], vector[participants + place] = self.declared, 1.0
        return vector


def declared_speeds(
    summed: Sequence[float], participants: int
) -> tuple[list[float | None], tuple[int, ...]]:
    """The participants' declared speeds (None: not yet measured) and their groups, by place."""
    p = participants
    speeds = [s if f == 1.0 else None for s, f in zip(summed[:p], summed[p : 2 * p], strict=True)]
    return speeds, tuple(round(g) - 1 for g in summed[2 * p : 3 * p])


def agreed_weights(summed: Sequence[float], participants: int) -> list[float] | None:
    """Each participant's weight from the summed declarations: its declared speed, or the mean
    of the declared ones where it has none; equal weights when nobody has declared; None when
    the sum is not one the participants made (a failed reduction: the step does not commit)."""
    speeds, declared = summed[:participants], summed[participants : 2 * participants]
    if any(f not in (0.0, 1.0) for f in declared) or not all(math.isfinite(s) for s in speeds):
        return None
    pairs = list(zip(speeds, declared, strict=True))
    known = [s for s, f in pairs if f == 1.0]
    if any(s <= 0 for s in known) or any(s != 0 for s, f in pairs if f == 0.0):
        return None
    if not known:
        return [1.0] * participants
    mean = sum(known) / len(known)
    return [s if f == 1.0 else mean for s, f in pairs]
