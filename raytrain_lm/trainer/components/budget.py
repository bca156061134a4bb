"""The chief's running account against `budget.max_usd` and `budget.deadline`.

Spend is what goodput.py prices from the run's events: every worker group's lifetime (this one
up to now, every earlier one, restarts and recoveries included) x its hourly price
(`fault.price_per_hour`). The projection adds the steps left at the recent step time and this
group's price. When the projection passes the budget, or the expected finish passes the
deadline, the run says so once; when the spend reaches the budget, the chief raises the stop
flag, and the group checkpoints at that step boundary and ends (`stop` event, `why: budget`):
resuming with a larger budget continues from exactly there.

Replica groups keep one segment while groups come and go, and their chief may change: the
chief's account (`RunningSpend`) starts from what the events price when it becomes chief and
adds what the groups taking part cost from then on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raytrain_lm.config import BudgetConfig
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.components.spot_first import DeadlineCapacity, slack_s
from raytrain_lm.trainer.progress import announce


def refuse_if_spent(budget: BudgetConfig, run: str, run_dir: RunDir) -> None:
    """Before a resume: a run whose spend has reached budget.max_usd would only start a worker
    group to stop it again, spending more."""
    limit = budget.max_usd
    spent = summarize(read_events(run_dir)).cost if limit is not None else 0.0
    if limit is not None and spent >= limit:
        raise UserError(
            f"run '{run}' has spent ${spent:,.2f} of budget.max_usd=${limit:,.2f}: raise it "
            "(--set budget.max_usd=...) to resume"
        )


class RunningSpend:
    """The run's spend as the replica groups' chief keeps it, at each of its steps: what the
    events price when it became chief (every earlier segment, and this one up to then at the
    prices its chiefs recorded), then the price of the groups taking part.

    The events are read on a thread of their own: in a bucket they are an object each, and a
    chief that read them inside a step would hold every group's reduction for as long. Until
    they are read, `add` counts what comes after and says nothing (None)."""

    def __init__(self, run_dir: RunDir, now: float):
        self.t, self.since = now, 0.0  # what the groups' price added after the read's `now`
        self._reading = lambda: _spent_and_first_start(read_events(run_dir), now)
        self.read: Future[tuple[float, float]] = _READER.submit(self._reading)

    def add(self, now: float, usd_per_hour: float) -> float | None:
        self.since += max(0.0, now - self.t) * usd_per_hour / 3600
        self.t = now
        if not self.read.done():
            return None
        if self.read.exception() is not None:  # the bucket was away: read again, counting on
            self.read = _READER.submit(self._reading)
            return None
        return self.read.result()[0] + self.since

    @property
    def first_start(self) -> float | None:
        """When the run first started (its first job), once the events are read."""
        done = self.read.done() and self.read.exception() is None
        return self.read.result()[1] if done else None


def _spent_and_first_start(events: list[dict[str, Any]], now: float) -> tuple[float, float]:
    return summarize(events, now).cost, first_start(events, now)


def first_start(events: list[dict[str, Any]], default: float) -> float:
    """When the run's first job started (`default` before any)."""
    starts = [e["t"] for e in events if e["event"] == "job_start"]
    return min(starts) if starts else default


_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spend-read")


class Projections:
    """`cost/spent`, `cost/projected` and `time/projected_finish_h` (and `time/slack_s` with a
    deadline) from the spend so far, saying once when either passes its limit."""

    def __init__(self, budget: BudgetConfig, end_step: int):
        self.budget, self.end_step = budget, end_step
        self.warned: set[str] = set()

    def metrics(
        self, spent: float, first_start: float, now: float, step: int, step_s: float,
        usd_per_hour: float,
    ) -> dict[str, float]:  # fmt: skip
        left_s = max(0, self.end_step - step) * step_s
        projected = spent + left_s * usd_per_hour / 3600
        finish_h = (now + left_s - first_start) / 3600
        limit, deadline_s = self.budget.max_usd, self.budget.deadline_s
        if limit is not None and projected > limit and "budget" not in self.warned:
            self.warned.add("budget")
            announce(
                f"budget: ${spent:,.2f} spent by step {step}; at this pace the run would cost "
                f"${projected:,.2f}, over budget.max_usd=${limit:,.2f}: it will stop, with a "
                "checkpoint, when the budget is spent"
            )
        if (
            deadline_s is not None
            and finish_h * 3600 > deadline_s
            and "deadline" not in self.warned
        ):
            self.warned.add("deadline")
            announce(
                f"deadline: at this pace the run finishes {finish_h:,.1f} h after its first "
                f"start, past budget.deadline={self.budget.deadline}"
            )
        metrics = {"cost/spent": spent, "cost/projected": projected,
                   "time/projected_finish_h": finish_h}  # fmt: skip
        if deadline_s is not None:
            metrics["time/slack_s"] = slack_s(step, self.end_step, now - first_start, deadline_s)
        return metrics


class BudgetGuard:
    def __init__(self, budget: BudgetConfig, run_dir: RunDir, end_step: int):
        """Called by the chief as its group starts, after the previous group's end is
        recorded and before this one's start: the earlier groups' spend is final then."""
        events = read_events(run_dir)
        self.budget, self.end_step = budget, end_step
        self.spent_before = summarize(events).cost
        self.first_start = first_start(events, time.time())
        self.projections = Projections(budget, end_step)
        self.capacity: DeadlineCapacity | None = (
            None  # scaling.capacity=spot_first (groups/static.py)
        )

    def spent(self, segment_events: list[dict[str, Any]], now: float) -> float:
        return self.spent_before + summarize(segment_events, now).cost

    def exhausted(self, segment_events: list[dict[str, Any]], now: float) -> bool:
        limit = self.budget.max_usd
        return limit is not None and self.spent(segment_events, now) >= limit

    def metrics(
        self, segment_events: list[dict[str, Any]], now: float, step: int, step_s: float,
        usd_per_hour: float,
    ) -> dict[str, float]:  # fmt: skip
        """The projections at `step` (Projections), from this segment's events so far."""
        spent = self.spent(segment_events, now)
        return self.projections.metrics(spent, self.first_start, now, step, step_s, usd_per_hour)
