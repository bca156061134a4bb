"""`scaling.balance=auto`: time each rank's forwards after a warm-up and re-plan the shares
from the measured speeds (the arithmetic is balance.py). A part of a static group's loop: it
asks at the reads the loop makes anyway, and forces the two it needs."""

from __future__ import annotations

from dataclasses import replace

from raytrain_lm.trainer.components.balance import MEASURE_STEPS, Speeds, replan_weights
from raytrain_lm.trainer.components.batch_plan import BatchPlan, share_metrics
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.pending_values import WARMUP_STEPS
from raytrain_lm.trainer.progress import announce


class Rebalancer:
    def __init__(self, parts: LoopParts, group, forced_reads: set[int]):
        self.parts, self.group = parts, group
        self.forced_reads = forced_reads  # the loop's: reads it makes whatever the cadences
        self.measure_after_warmup(first_plan=True)

    def measure_after_warmup(self, first_plan: bool) -> None:
        """Time forwards from WARMUP_STEPS steps on (after a start or a re-plan: the first
        passes of a new shape compile, and a restarted stream refills its cache), and make the
        group's first plan MEASURE_STEPS steps later."""
        self.measured_from = self.parts.progress.step + WARMUP_STEPS
        self.first_plan = first_plan
        self.forced_reads.add(self.measured_from)
        if first_plan:
            self.forced_reads.add(self.measured_from + MEASURE_STEPS)

    def after_read(self, checkpointed: bool) -> None:
        measured = self.parts.progress.step - self.measured_from
        if measured == 0:
            self.parts.trainee.clock.take()  # the warm-up's forwards: not the steady pace
        elif measured == MEASURE_STEPS or (checkpointed and measured > MEASURE_STEPS):
            self._rebalance(first=self.first_plan and measured == MEASURE_STEPS)

    def _rebalance(self, first: bool) -> None:
        """Every rank, at the same read: gathers each rank's measured forward speed and
        re-plans the shares when the current ones leave the slowest rank's forwards longer than
        the mean by more than `scaling.balance_tolerance`."""
        parts, group, trainee = self.parts, self.group, self.parts.trainee
        speeds = Speeds.gather(trainee.clock, group.rank, group.world, parts.device)
        weights = replan_weights(speeds, trainee.plan.shares, parts.cfg.scaling.balance_tolerance)
        self.first_plan = False
        if weights is None:
            return
        imbalance = speeds.imbalance(trainee.plan.shares)
        plan = BatchPlan.derive(parts.cfg.training, group.world, weights,
                                same_passes=trainee.sharded)  # fmt: skip
        if plan.shares == trainee.plan.shares:
            return
        trainee.plan = plan
        parts.step_parts = replace(parts.step_parts, plan=plan)
        parts.batches.close()  # the stream is per share: restart it at this step
        parts.batches = group.data_stream()
        step, reason = parts.progress.step, "measured" if first else "drift"
        rates = [round(r, 2) for r in speeds.per_second]
        if group.is_chief:
            parts.journal.event(
                "batch_plan", step=step, reason=reason, shares=list(plan.shares),
                passes=list(plan.passes), sequences_per_s=rates, imbalance=round(imbalance, 4),
                types=trainee.where.types,
            )  # fmt: skip
            announce(
                f"balance at step {step} ({reason}: the slowest rank's forwards took "
                f"{imbalance:.0%} over the mean; sequences/s {rates}): {plan.describe()}"
            )
        parts.tracker.log_metrics(share_metrics(plan), step=step)
        parts.restart_step_clock()
        parts.journal.throughput.restart_steady(step)  # tokens/s of the plan now in use
        self.measure_after_warmup(first_plan=False)
