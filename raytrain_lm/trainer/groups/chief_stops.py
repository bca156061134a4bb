"""Why the replica groups' chief raises the stop flag, which every group sees in the step
(replica_step.py) and ends on with a checkpoint: a stop request, or `budget.max_usd` spent. The
run's spend is kept by whichever group is chief (budget.RunningSpend), so a lost chief's
successor goes on counting it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raytrain_lm.config import RunConfig
from raytrain_lm.errors import UserError
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.batch_plan import end_step
from raytrain_lm.trainer.components.budget import Projections, RunningSpend
from raytrain_lm.trainer.components.cadence import Every
from raytrain_lm.trainer.progress import announce

if TYPE_CHECKING:
    from raytrain_lm.trainer.groups.replicas import ReplicaGroup


REASONS = ("request", "budget")


class ChiefStops:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, accelerator: str, usd_per_hour: float):
        self.limit = cfg.budget.max_usd
        if self.limit is not None and not usd_per_hour:  # it would cost nothing: refuse
            raise UserError(
                f"budget.max_usd: fault.price_per_hour gives no price for this replica group's "
                f"type ({accelerator}); add it, or a `default`"
            )
        self.run_dir = run_dir
        self.checks = Every(seconds=cfg.fault.preemption_check_s)
        self.spend: RunningSpend | None = None
        self.chief = False  # whether this group was chief at its last `due`
        # budget.* set: the chief keeps the run's spend, and its projections are metrics.
        keeps_account = cfg.budget.max_usd is not None or cfg.budget.deadline is not None
        self.projections = (
            Projections(cfg.budget, end_step(cfg.training)) if keeps_account else None
        )
        self.reason = "request"  # or "budget": what the stop event says (stop_requests.stop_why)

    def flag(self, group: ReplicaGroup) -> float:
        """The stop flag this group sends in a step's or a round's sums: 0, or the code of
        the chief's reason (1 + its place in REASONS), so that whichever group is chief when
        the stop is written says why, also when the chief changed in between."""
        return float(1 + REASONS.index(self.reason)) if self.due(group) else 0.0

    def seen(self, summed: float) -> bool:
        """Whether the summed flag says stop (only the chief sends one), and why."""
        code = round(summed)
        if code > 0:
            self.reason = REASONS[code - 1]
        return code > 0

    def due(self, group: ReplicaGroup, now: float | None = None) -> bool:
        """Every group's, at every step or round it takes: whether the chief raises the stop
        flag now (the checks run on the preemption check's clock; the chief adds up the
        spend at every call, and a group that is not chief forgets its account, which
        another chief keeps meanwhile)."""
        self.chief = group.is_chief
        if not self.chief:
            self.spend = None
            return False
        parts, now = group.parts, time.time() if now is None else now
        spent = self._spent(now, group.price_per_hour())
        if not self.checks.due(parts.progress.step, parts.end_step):
            return False
        if stop_requests.stop_requested(self.run_dir):
            self.reason = "request"
            return True
        if spent is None or self.limit is None or spent < self.limit:
            return False
        self.reason = "budget"
        announce(f"budget: ${spent:,.2f} spent, budget.max_usd reached")
        return True

    def _spent(self, now: float, usd_per_hour: float) -> float | None:
        """The run's spend, None until this chief has read the events (budget.py)."""
        if self.projections is None:
            return None
        if self.spend is None:
            self.spend = RunningSpend(self.run_dir, now)  # reads the events: as it takes over
        return self.spend.add(now, usd_per_hour)

    def metrics(
        self, segment_events: list, now: float, step: int, step_s: float, usd_per_hour: float
    ) -> dict[str, float]:
        """The chief's projections (budget.Projections) from the spend it keeps, as the group's
        `budget` (components/metrics.py): whichever group is chief, once it has read the
        events. This group's own journal (`segment_events`) is not the run's: not used."""
        if self.spend is None or not self.chief:  # a chief demoted since its last `due`
            return {}
        spent = self.spend.add(now, usd_per_hour)  # up to now (a DiLoCo sync's time too)
        first_start = self.spend.first_start
        if spent is None or first_start is None:
            return {}
        return self.projections.metrics(spent, first_start, now, step, step_s, usd_per_hour)

    def forget(self) -> None:
        """A group that healed (it sat out the other chiefs' steps): its account is stale."""
        self.spend = None
