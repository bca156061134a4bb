"""The metrics of the steps read at once (pending_values.py): each step's loss and gradient
norm, and for the newest one the interval's speed (tokens/s, MFU against the peaks of the
devices that trained, step time, the share of it spent waiting for data), what it costs per type
of accelerator, the budget's projections and the live goodput; and the validation loss."""

from __future__ import annotations

import time

import torch

from raytrain_lm import devices
from raytrain_lm.trainer.components.balance import per_type_metrics
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.pending_values import Interval
from raytrain_lm.trainer.components.trainee import Trainee


def peaks(trainee: Trainee, types: list[str]) -> list[float]:
    """The peak FLOP/s of the device each rank of `types` trains on: the one definition behind
    every MFU figure (the progress line's, the per-type ones, the summary's)."""
    own = trainee.where.types[trainee.where.rank]
    return devices.training_peaks(types, trainee.device, own)


def per_type(trainee: Trainee, types: list[str], prices: list[float], tokens_per_s: float):
    """Per accelerator type: tokens/s, MFU, cost per million tokens (balance.py), for the
    plan's shares (empty while the shares' types are not known)."""
    if len(types) != len(trainee.plan.shares):
        return {}
    return per_type_metrics(types, trainee.plan.shares, tokens_per_s,
                            trainee.flops_per_token, prices, peaks(trainee, types))  # fmt: skip


class StepMetrics:
    def __init__(self, parts: LoopParts, group, sync):
        self.parts, self.group, self.sync = parts, group, sync
        self.forced_reads: set[int] = set()

    def read(self, live_goodput: bool) -> dict[str, float]:
        """Reads the steps queued since the last read (every rank at the same step): logs
        all but the newest, and returns the newest's metrics with the interval's speed."""
        parts, group = self.parts, self.group
        journal, trainee, tracker = parts.journal, parts.trainee, parts.tracker
        interval: Interval = parts.progress.pending.read()
        *earlier, (step, metrics) = interval.steps
        for earlier_step, earlier_metrics in earlier:
            tracker.log_metrics(earlier_metrics, step=earlier_step)
        parts.progress.train_loss = metrics["train/loss"]
        steps, seconds = len(interval.steps), max(interval.seconds, 1e-9)
        tokens = steps * trainee.tokens_per_step
        journal.throughput.add(step, seconds, tokens, steps)
        if step == journal.throughput.first_step + 1 and journal.events:
            journal.keep("first_step", segment=journal.segment)
        tokens_per_s = tokens / seconds
        types, prices = group.roster()
        metrics.update(
            {
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": devices.group_mfu(
                    trainee.flops_per_token, tokens_per_s, peaks(trainee, types or ["?"])
                ),
                "perf/step_time_s": seconds / steps,
                "perf/data_wait_fraction": min(1.0, interval.data_wait_s / seconds),
            }
        )
        metrics |= group.metrics(tokens_per_s) | self.sync.metrics()
        if group.budget is not None:
            metrics |= group.budget.metrics(journal.events, time.time(), step, seconds / steps,
                                            group.price_per_hour())  # fmt: skip
        if parts.device.type == "cuda":  # the caching allocator's count: no device sync
            peak = torch.cuda.max_memory_allocated(parts.device)
            metrics["perf/memory_peak_gib"] = peak / 2**30
        if group.is_chief:
            for kind, figures in per_type(trainee, types, prices, tokens_per_s).items():
                for name in ("tokens_per_s", "mfu", "usd_per_mtok"):
                    if name in figures:
                        metrics[f"perf/{kind}/{name}"] = figures[name]
        if live_goodput and journal.events:
            metrics.update(journal.live_goodput(parts.progress.state.tokens,
                                                trainee.tokens_per_step))  # fmt: skip
        return metrics

    def validate(self) -> float:
        """The validation loss now (a collective over the group); its time is not step time."""
        parts = self.parts
        state = parts.progress.state
        state.val_loss, state.val_step = parts.evaluate(parts.trainee.model), state.step
        parts.restart_step_clock()
        return state.val_loss
