"""`scaling.balance=auto` in the worker loop: time each rank's forwards after a warm-up and
re-plan the shares from the measured speeds (a part of Worker, worker.py; the arithmetic is
balance.py).
"""

from __future__ import annotations

from dataclasses import replace

from raytrain_lm.trainer.components.balance import MEASURE_STEPS, Speeds, replan_weights
from raytrain_lm.trainer.components.batch_plan import BatchPlan
from raytrain_lm.trainer.components.pending_values import WARMUP_STEPS
from raytrain_lm.trainer.progress import announce


class Rebalancing:
    """The Worker's measuring and re-planning methods."""

    def _measure_after_warmup(self, first_plan: bool) -> None:
        """balance auto: time forwards from WARMUP_STEPS steps on (after a start or a re-plan:
        the first passes of a new shape compile, and a restarted stream refills its cache),
        and make the group's first plan MEASURE_STEPS steps later."""
        self.measured_from = self.state.step + WARMUP_STEPS
        self.first_plan = first_plan
        self.forced_reads.add(self.measured_from)
        if first_plan:
            self.forced_reads.add(self.measured_from + MEASURE_STEPS)

    def _rebalance(self, first: bool) -> None:
        """balance auto (every rank, at the same read): gathers each rank's measured forward
        speed and re-plans the shares when the current ones leave the slowest rank's forwards
        longer than the mean by more than `scaling.balance_tolerance`."""
        speeds = Speeds.gather(self.clock, self.rank, self.world, self.device)
        weights = replan_weights(speeds, self.plan.shares, self.cfg.scaling.balance_tolerance)
        self.first_plan = False
        if weights is None:
            return
        imbalance = speeds.imbalance(self.plan.shares)
        plan = BatchPlan.derive(self.cfg.training, self.world, weights, same_passes=self.sharded)
        if plan.shares == self.plan.shares:
            return
        self.plan = plan
        self.parts = replace(self.parts, plan=plan)
        self.batches.close()  # the stream is per share: restart it at this step
        self.batches = self._batches()
        reason = "measured" if first else "drift"
        rates = [round(r, 2) for r in speeds.per_second]
        if self.is_chief:
            self._event(
                "batch_plan",
                step=self.state.step,
                reason=reason,
                shares=list(plan.shares),
                passes=list(plan.passes),
                sequences_per_s=rates,
                imbalance=round(imbalance, 4),
                types=self.types,
            )
            announce(
                f"balance at step {self.state.step} ({reason}: the slowest rank's forwards took "
                f"{imbalance:.0%} over the mean; sequences/s {rates}): {plan.describe()}"
            )
        self.tracker.log_metrics(self._plan_metrics(), step=self.state.step)
        self._restart_step_clock()
        self.throughput.restart_steady(self.state.step)  # tokens/s of the plan now in use
        self._measure_after_warmup(first_plan=False)

    def _plan_metrics(self) -> dict[str, float]:
        return {f"plan/rank{r}_share": float(n) for r, n in enumerate(self.plan.shares)}
