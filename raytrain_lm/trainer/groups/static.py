"""`scaling.fault_tolerance=restart`: the workers of one Ray Train group train as one process
group (DDP, FSDP, HSDP, tensor parallel), rank 0 writes for it, and any incident ends the group:
Ray Train (or the driver, after a spot notice or a stop) starts a new one from the newest
checkpoint."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from raytrain_lm import devices
from raytrain_lm.data.stream import WorkerSlice
from raytrain_lm.errors import UserError
from raytrain_lm.placement import OnDemandRequests
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.tracking import MLflowTracker, NullTracker, Tracker
from raytrain_lm.trainer.checkpointing.resume import restore_newest
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.budget import BudgetGuard
from raytrain_lm.trainer.components.cadence import Flags
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.pending_values import WARMUP_STEPS
from raytrain_lm.trainer.components.rebalancing import Rebalancer
from raytrain_lm.trainer.components.spot_first import (
    DeadlineCapacity,
    measured_restart_s,
    returned_to_spot,
)
from raytrain_lm.trainer.components.state import Settled
from raytrain_lm.trainer.components.step import StepParts
from raytrain_lm.trainer.components.trainee import Trainee, where_in_group
from raytrain_lm.trainer.distributed.collectives import FlagChannel, all_reduce
from raytrain_lm.trainer.groups.feed import open_stream
from raytrain_lm.trainer.groups.start import record_start, start_metrics
from raytrain_lm.trainer.progress import ProgressBar, announce
from raytrain_lm.trainer.spec import WorkerSpec


class StaticGroup:
    def __init__(self, spec: WorkerSpec, ray, rank: int, world: int):
        self.spec, self.ray, self.rank, self.world = spec, ray, rank, world
        self.fault_rank = rank  # the rank a chaos test's fault names (chaos.py)
        self.upload_deadline: float | None = None  # a spot notice's (wall clock)
        self.parts: LoopParts | None = None
        self.budget: BudgetGuard | None = None  # the chief's, with budget.* set
        self.interruptions = (0.0, 0.0)  # checkpoint.every_steps=auto: the chief's count
        self.stop_reason = "request"  # or "budget", "capacity": why a stop flag went up
        self.prices: list[float] = []
        self.regular_read = False  # the loop's: whether its read now is one every rank makes

    # ------------------------------------------------------------------------------ who

    @property
    def is_chief(self) -> bool:
        """The one worker that writes run files, events and metrics."""
        return self.rank == 0

    speaks_for_run = is_chief

    def build_trainee(self, spec: WorkerSpec, device: torch.device) -> Trainee:
        needs_nodes = spec.config.parallel.strategy != "ddp"
        where = where_in_group(self.ray, self.rank, self.world, device, self.is_chief,
                               needs_nodes)  # fmt: skip
        return Trainee(spec.config, spec.data_dir, device, where, spec.checkpoint_strategy)

    def tracker(self) -> Tracker:
        tracking = self.spec.tracking
        if self.is_chief and tracking is not None:
            return MLflowTracker(tracking.uri, tracking.run_id)
        return NullTracker()

    def attach(self, parts: LoopParts) -> None:
        self.parts = parts
        self.flag_channel = FlagChannel(parts.device, parts.cfg.fault.collective_timeout_s)
        prices, market = parts.cfg.fault.price_per_hour, self.ray.node_market()
        types = parts.trainee.where.types
        self.my_price = devices.price_per_hour(prices, types[self.rank], market) or 0.0

    def progress_bar(self) -> ProgressBar | None:
        parts = self.parts
        if self.is_chief and parts.cfg.training.progress:
            return ProgressBar(parts.end_step, parts.progress.step, parts.cfg.training.log_every)
        return None

    # ------------------------------------------------------------------------------ start

    def data_stream(self, step: int | None = None):
        """This rank's share of every step from `step` on (the current one if None)."""
        trainee, plan = self.parts.trainee, self.parts.trainee.plan
        part = WorkerSlice(trainee.data_rank, trainee.data_world, plan.global_batch, plan.shares)
        return open_stream(self.parts, part, step)

    @contextlib.contextmanager
    def running(self, emergency_checkpoint) -> Iterator[None]:
        yield  # any incident ends the whole group: Ray Train or the driver starts the next

    def join(self, prepare, on_manager) -> bool:
        """Loads the newest checkpoint that verifies and loads, the same on every rank."""
        restore_newest(self.parts, self.rank)
        return True

    def start(self) -> None:
        """Records this worker group's start (events, ledger, first metrics) and announces it."""
        parts = self.parts
        cfg, state, trainee = parts.cfg, parts.progress.state, parts.trainee
        plan = trainee.plan
        types = trainee.where.types
        # Each rank's price in its own slot: ranks of one type may sit on spot and on-demand.
        mine = [self.my_price * (r == self.rank) for r in range(self.world)]
        self.prices = all_reduce(mine, parts.device)
        group_price, unpriced = sum(self.prices), sum(price == 0 for price in self.prices)
        if unpriced and cfg.budget.max_usd is not None:  # it would cost nothing: refuse
            raise UserError(
                f"budget.max_usd: fault.price_per_hour gives no price for {int(unpriced)} of the "
                f"workers' types ({sorted(set(types))}); add them, or a `default`"
            )
        self.group_price = group_price
        world_size = plan.world_size * trainee.layout.tensor
        if self.is_chief:
            nodes = sorted(self.ray.alive_node_ids())
            self.budget, self.interruptions = record_start(parts, nodes, world_size, group_price)
        parts.tracker.log_metrics(start_metrics(parts), step=state.step)

    def rebalancer(self, forced_reads: set[int]) -> Rebalancer | None:
        """The group re-plans its ranks' shares at its reads (rebalancing.py)."""
        clock = self.parts.trainee.clock
        return Rebalancer(self.parts, self, forced_reads) if clock is not None else None

    def forced_reads(self, step: int) -> set[int]:
        """Reads at a group's first step and at the end of its warm-up, so that neither the
        start-up nor the warm-up steps blur a steady interval's tokens/s."""
        return {step + 1, step + WARMUP_STEPS}

    # ------------------------------------------------------------------------------ steps

    def begin_step(self, step: int) -> tuple[StepParts, int]:
        """The step parts and the rank its dropout is seeded by: fixed for the group's life
        (but for a re-plan, rebalancing.py)."""
        return self.parts.step_parts, self.parts.trainee.data_rank

    def take(self, step: int):
        return next(self.parts.batches)

    def exchange(self, model, loss: torch.Tensor, positions):
        """Gradients were all-reduced in the backward (DDP, FSDP); nothing else to sum now."""
        return None

    vote = None  # every rank applies every step: nothing to vote on

    def settle(self, summed, positions: np.ndarray, loss: torch.Tensor) -> Settled:
        """This rank's loss part and positions (in the ledger unless a tensor-parallel peer
        records the same)."""
        trainee, cfg = self.parts.trainee, self.parts.cfg
        records = cfg.training.ledger and trainee.layout.tensor_rank(self.rank) == 0
        return Settled(loss, positions if records else None)

    # ------------------------------------------------------------------------------ flags

    def flags(self, step: int) -> Flags:
        """Rank 0's signal flags (whether to ask Ray about preemption, whether a stop was
        requested), carried to every rank each step without waiting for the device."""
        parts = self.parts
        ask = self.is_chief and parts.every.signals.due(step, parts.end_step)
        stop = ask and (stop_requests.stop_requested(parts.run_dir) or self._chief_stops())
        asks, stops = self.flag_channel.share([int(ask), int(stop)])
        return Flags(ask=asks > 0, stop=stops > 0)

    def ends(self, flags: Flags) -> bool:
        """After rank 0 raised a flag (every rank calls this at the same step): whether this
        group ends now, with a checkpoint, for a stop request or a spot notice."""
        parts = self.parts
        journal, step = parts.journal, parts.progress.step
        if flags.stop:
            reason = stop_requests.STOP
            if self.is_chief:
                why = self.stop_reason
                extra = {"market": self.budget.capacity.switch_to} if why == "capacity" else {}
                journal.keep(stop_requests.STOP, step=step, why=why, **extra)
                if why == "budget":
                    spent = self.budget.spent(journal.events, time.time())
                    announce(f"budget: ${spent:,.2f} spent, budget.max_usd reached")
        else:
            info = self.ray.preemption_info()  # a collective: every rank asks
            if info is None or not parts.cfg.fault.checkpoint_on_preemption:
                return False
            # A node of ours is being drained: checkpoint now and end this group, so the
            # driver restarts at once on the nodes that stay; steps taken while waiting for
            # the node to vanish would only be recomputed.
            reason = stop_requests.PREEMPTION
            self.upload_deadline = info.deadline_ms / 1000 if info.deadline_ms else None
            if self.is_chief:
                ranks = sorted(info.preempted_ranks)
                journal.keep(reason, step=step, deadline_ms=info.deadline_ms, ranks=ranks)
                announce(f"preemption notice for ranks {ranks}")
        announce(
            f"{reason}: just-in-time checkpoint at step {step}, then this worker group ends",
            self.is_chief,
        )
        return True

    def _chief_stops(self) -> bool:
        """Rank 0: whether budget.max_usd is spent, or scaling.capacity=spot_first moves the
        run to other nodes (then the stop flag goes up, as for a stop request, and the group
        checkpoints and ends)."""
        parts = self.parts
        cfg, journal, step = parts.cfg, parts.journal, parts.progress.step
        if self.budget is None:
            return False
        if self.budget.exhausted(journal.events, time.time()):
            self.stop_reason = "budget"
            return True
        if cfg.scaling.capacity != "spot_first" or step >= parts.end_step:
            return False  # at the last step nothing is left to move (the run withdraws at exit)
        if self.budget.capacity is None:
            events = read_events(parts.run_dir)
            self.budget.capacity = DeadlineCapacity(
                market=self.spec.market,
                deadline_s=cfg.budget.deadline_s,
                first_start=self.budget.first_start,
                end_step=parts.end_step,
                max_workers=cfg.scaling.max_size,
                restart_s=measured_restart_s(events),
                returned=returned_to_spot(events),
                requests=OnDemandRequests(
                    cfg.name, cfg.scaling, parts.device.type == "cuda", parts.trainee.where.types[0]
                ),
            )
        decision = self.budget.capacity.check(step, self.world)
        for note in decision.notes:
            journal.keep(note.event, **note.fields)
            announce(note.line)
        if decision.switch_to is None:
            return False
        self.stop_reason = "capacity"  # the stop event names the market (launch.py)
        return True

    # ------------------------------------------------------------------------------ figures

    def agree_interval(self, steps: int, since: int) -> None:
        """Every rank chose this interval from the same all-reduced figures: in use now."""
        self.parts.every.checkpoint.count_every(steps, since)

    def roster(self) -> tuple[list[str], list[float]]:
        """The accelerator type and hourly price (0: none given) of each share of the plan."""
        return self.parts.trainee.where.types, self.prices

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        return {}

    def price_per_hour(self) -> float:
        return self.group_price

    # ------------------------------------------------------------------------------ writing

    def checkpoint_turn(self, final: bool) -> tuple[str, bool]:
        """Every rank writes its part (the chief the whole state, unless sharded) and reports
        to Ray Train, whose report is a collective."""
        return "write", final

    def publish(self, report: dict[str, float], local: Path | None, wait: bool, upload) -> None:
        """Reports the metrics and this rank's part of the checkpoint (None: none) to Ray Train,
        which uploads it with `upload`, in the background unless `wait`."""
        self.ray.report(report, local, wait=wait, upload=upload)
