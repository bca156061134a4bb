"""The expected wall time of a run that is interrupted at random, and the checkpoint interval
that minimises it. Pure arithmetic: no Ray, no torch.

A run needs W seconds of training. It checkpoints after every tau seconds of training, each
checkpoint taking C seconds; interruptions arrive as a Poisson process of rate lam per second
(all nodes together: in restart mode one lost node interrupts every worker); each costs the
time since the last checkpoint plus R seconds to come back (detect, re-provision, restore).
One segment (tau of work, then its checkpoint) must run X = tau + C seconds without an
interruption. Attempts fail e^(lam X) - 1 times on average, each losing on average
1/lam - X e^(-lam X) / (1 - e^(-lam X)) seconds plus R, so a segment takes on average

    E[segment] = (1/lam + R) (e^(lam X) - 1)

(the first-order model of Daly, "A higher order estimate of the optimum checkpoint interval",
2006, with R itself never interrupted), and the run W / tau segments. Without interruptions
(lam -> 0) a segment takes exactly X. The interval that minimises it has no closed form;
Young's sqrt(2 C / lam) and Daly's sqrt(2 C (1/lam + R)) - C approximate it, and
`best_interval` finds it numerically.
"""

from __future__ import annotations

import math


def expected_wall_s(work_s: float, interval_s: float, checkpoint_s: float, rate_per_s: float,
                    recovery_s: float) -> float:  # fmt: skip
    """Expected seconds to finish `work_s` of training (see the module docstring)."""
    if work_s <= 0:
        return 0.0
    segment = interval_s + checkpoint_s
    if rate_per_s <= 0:
        return work_s / interval_s * segment if math.isfinite(interval_s) else work_s
    if not math.isfinite(interval_s):  # no checkpoints: every interruption starts over
        interval_s, segment = work_s, work_s
    attempts = math.expm1(rate_per_s * segment)
    return work_s / interval_s * (1.0 / rate_per_s + recovery_s) * attempts


def young_daly_interval_s(checkpoint_s: float, rate_per_s: float, recovery_s: float) -> float:
    """Daly's first-order optimum, sqrt(2 C (MTBF + R)) - C; infinite without interruptions."""
    if rate_per_s <= 0:
        return math.inf
    return max(
        checkpoint_s, math.sqrt(2 * checkpoint_s * (1 / rate_per_s + recovery_s)) - checkpoint_s
    )


def best_interval_s(work_s: float, checkpoint_s: float, rate_per_s: float,
                    recovery_s: float) -> float:  # fmt: skip
    """The checkpoint interval (seconds of training) with the least expected wall time, at
    most the whole run: a golden-section search on log(interval) around Young/Daly's."""
    if rate_per_s <= 0 or work_s <= 0:
        return math.inf

    def wall(log_tau: float) -> float:
        return expected_wall_s(work_s, math.exp(log_tau), checkpoint_s, rate_per_s, recovery_s)

    guess = min(young_daly_interval_s(checkpoint_s, rate_per_s, recovery_s), work_s)
    lo, hi = math.log(max(guess / 100, 1e-3)), math.log(min(guess * 100, work_s))
    if hi <= lo:
        return work_s
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    for _ in range(80):
        if wall(a) < wall(b):
            hi, b = b, a
            a = hi - ratio * (hi - lo)
        else:
            lo, a = a, b
            b = lo + ratio * (hi - lo)
    best = math.exp((lo + hi) / 2)
    # Checkpointing only at the end may be better still when interruptions are rare.
    return work_s if wall(math.log(work_s)) <= wall(math.log(best)) else best
