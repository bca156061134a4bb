"""`checkpoint.every_steps: auto`: after each checkpoint, the interval (in steps) that
minimises the run's expected wall time (costs/model.py), from what the run measured: the
slowest rank's save time, its step time, and its interruption rate.

The rate is the run's interruptions (preemptions and failures) over the hours it has run,
with a prior of one interruption per day of running: a run that has seen none yet still
checkpoints (about every sqrt(2 x save x 24 h): 7 minutes for a 1-second save), and one on
flaky capacity checkpoints more often as the incidents come. Recovery per incident is the
run's measured mean, else costs.planner's default.
"""

from __future__ import annotations

import math

from raytrain_lm.costs.model import best_interval_s
from raytrain_lm.costs.planner import DEFAULT_RECOVERY_S
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir

PRIOR_HOURS = 24.0  # one interruption assumed per this many hours until the run has its own


def observed_interruptions(run_dir: RunDir) -> tuple[float, float]:
    """(interruptions per second, recovery seconds per interruption) from the run's events."""
    events = read_events(run_dir)
    goodput = summarize(events)
    failures = sum(1 for e in events if e["event"] == "failure_detected")
    incidents = goodput.preemptions + failures
    rate = (incidents + 1) / (goodput.wall_s + PRIOR_HOURS * 3600)
    recovery = goodput.recovery_s / incidents if incidents else DEFAULT_RECOVERY_S
    return rate, recovery


def interval_steps(
    save_s: float, step_s: float, rate_per_s: float, recovery_s: float, steps_left: int
) -> int:
    """Steps between checkpoints; `steps_left` (none before the end) when that is best."""
    if steps_left <= 0 or step_s <= 0 or not math.isfinite(step_s):
        return max(1, steps_left)
    best = best_interval_s(steps_left * step_s, save_s, rate_per_s, recovery_s)
    return max(1, min(steps_left, round(best / step_s)))
