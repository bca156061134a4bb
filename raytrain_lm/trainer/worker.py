"""One worker's training run: build, restore, then step, with its periodic work (logging,
evaluation, checkpoints, the stop and spot-notice protocol) declared in one table (cadence.py).

Pure PyTorch and files: what it needs of Ray Train (its device, the group's nodes and types,
spot notices, reporting checkpoints) it asks of a `RaySide` (ray_side.py, with entry.py the one
place that calls Ray Train's per-worker API). It drives the parts: one optimizer step
(step.py), validation (evaluation.py), checkpoint contents (raytrain_lm/checkpoints),
restoring (restore.py), the stop and preemption protocol (stop_requests.py), goodput events (goodput.py). Each part gets only the
settings it needs. `scaling.fault_tolerance=replicas` runs `ReplicaWorker` (replicas.py),
which changes how a step's participants are found, not this loop.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raytrain_lm import devices
from raytrain_lm.checkpoints import TrainState
from raytrain_lm.config import BALANCE_AUTO_UNDER_FSDP
from raytrain_lm.data import ledger
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.order import SequenceOrder
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import (
    Heartbeat,
    HeartbeatWriter,
    append_event,
    close_previous_segment,
)
from raytrain_lm.tokenization import load_tokenizer
from raytrain_lm.tracking.interface import NullTracker, Tracker
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.checkpoint_interval import observed_interruptions
from raytrain_lm.trainer.checkpointing.restore import restore_group
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.balance import (
    MEASURE_STEPS,
    ForwardClock,
    per_type_metrics,
    type_weights,
)
from raytrain_lm.trainer.components.batch_plan import BatchPlan, end_step, learning_rate
from raytrain_lm.trainer.components.budget import BudgetGuard
from raytrain_lm.trainer.components.cadence import Cadences, Flags
from raytrain_lm.trainer.components.evaluation import Evaluator
from raytrain_lm.trainer.components.group_endings import Endings
from raytrain_lm.trainer.components.pending_values import (
    WARMUP_STEPS,
    Interval,
    PendingSteps,
    Throughput,
)
from raytrain_lm.trainer.components.rebalancing import Rebalancing
from raytrain_lm.trainer.components.step import StepParts, step_seed, train_step
from raytrain_lm.trainer.components.watchdog import StepWatchdog
from raytrain_lm.trainer.distributed.collectives import FlagChannel, all_reduce
from raytrain_lm.trainer.distributed.mesh import Layout
from raytrain_lm.trainer.distributed.parallel import (
    apply_layout,
    choose_layout,
    device_memory_bytes,
    replicate_model,
)
from raytrain_lm.trainer.progress import ProgressBar, announce
from raytrain_lm.trainer.spec import WorkerSpec

if TYPE_CHECKING:
    from raytrain_lm.trainer.ray_side import RaySide


class Worker(Rebalancing, Endings):
    """One worker's run: what it built, where it is, and the periodic work of its loop."""

    def __init__(self, spec: WorkerSpec, ray_side: RaySide, rank: int, world: int, t_start: float):
        cfg = spec.config
        self.spec, self.cfg, self.rank, self.world, self.t_start = spec, cfg, rank, world, t_start
        self.ray = ray_side
        self.device = ray_side.device
        devices.configure_device(self.device)
        self.bf16 = devices.use_bf16(self.device, cfg.training.precision)
        self.compile = devices.use_compile(self.device, cfg.training.compile)
        self.run_dir = spec.run_dir

        self.manifest = Manifest.load(spec.data_dir)
        self.tokenizer_json = load_tokenizer(spec.data_dir).to_json()
        self.end_step = end_step(cfg.training)
        torch.manual_seed(cfg.training.seed)
        self.model = build_model(cfg.model, self.manifest.vocab_size).to(self.device)
        if cfg.model.init_from:  # a restore below replaces these weights when resuming
            from raytrain_lm.huggingface import load_hf_weights

            load_hf_weights(self.model, cfg.model.init_from)
        self.layout = self._choose_layout()
        self.strategy = self.layout.strategy
        apply_layout(
            self.model, self.layout, self.device, self.bf16, cfg.parallel.reshard_after_forward,
            self.compile, cfg.training.activation_checkpointing,
        )  # fmt: skip
        # A tensor-parallel group reads the same sequences: data is split over the groups.
        self.data_rank, self.data_world = self.layout.data_rank(rank), self.layout.data_world
        self.types = self.ray.accelerator_types(world, self.device)  # each rank's, on every rank
        prices, market = cfg.fault.price_per_hour, self.ray.node_market()
        self.my_price = devices.price_per_hour(prices, self.types[rank], market) or 0.0  # 0: none
        self.plan = self._initial_plan()
        self.optimizer = devices.build_adamw(
            self.model.optimizer_groups(cfg.optim.weight_decay),
            cfg.optim.lr,
            (cfg.optim.beta1, cfg.optim.beta2),
            self.device,
        )
        self.tracker: Tracker = self._tracker()
        self.flops_per_token = self.model.flops_per_token()
        self.tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
        self.decay_steps = cfg.optim.decay_steps or cfg.training.max_steps
        self.every = Cadences.of(cfg)
        self.watchdog = StepWatchdog(cfg.fault.step_timeout_s)
        self.flag_channel = FlagChannel(self.device, cfg.fault.collective_timeout_s)
        self.pending = PendingSteps(world, loss_copies=self.layout.tensor)
        self.sync_counter = chaos.sync_counter(spec.fault, self.device)
        self.clock = ForwardClock(self.device) if cfg.scaling.balance == "auto" else None
        chaos.simulate_device(self.model, spec.fault, self.fault_rank)
        self.pacer = chaos.Pacer(spec.fault, self.run_dir)

        self.parts: StepParts | None = None  # from _prepare_loop
        self.state = TrainState()
        self.segment = uuid.uuid4().hex[:12]
        self.events: list[dict[str, Any]] = []
        self.throughput = Throughput(first_step=0)
        self.ledger: list[np.ndarray] = []  # positions consumed since the last checkpoint
        self.last_report_step = 0
        self.upload_deadline: float | None = None  # a spot notice's deadline (wall clock)
        self.heartbeats: HeartbeatWriter | None = None  # rank 0's, from start()
        self.budget: BudgetGuard | None = None  # rank 0's, from start(), with budget.* set
        self.stop_reason = "request"  # or "budget", "capacity": why a stop flag went up
        self.train_loss = float("nan")
        self.tick = time.perf_counter()  # when this step began, on the host (for pacing)

    @property
    def sharded(self) -> bool:
        return self.strategy != "ddp"

    @property
    def is_chief(self) -> bool:
        """The one worker that writes run files, events and metrics."""
        return self.rank == 0

    @property
    def fault_rank(self) -> int:
        """The rank a chaos test's fault names (trainer/chaos.py)."""
        return self.rank

    def _tracker(self) -> Tracker:
        if self.is_chief and self.spec.tracking is not None:
            return MLflowTracker(self.spec.tracking.uri, self.spec.tracking.run_id)
        return NullTracker()

    def _progress(self) -> ProgressBar | None:
        if self.is_chief and self.cfg.training.progress:
            return ProgressBar(self.end_step, self.state.step, self.cfg.training.log_every)
        return None

    def _choose_layout(self) -> Layout:
        """parallel.strategy, with `auto` settled from the memory the group's state needs
        against its smallest device, and where each rank sits in the mesh (mesh.py); the same
        on every rank."""
        setting = self.cfg.parallel.strategy
        # Under ddp no mesh is built: which node holds which rank does not matter.
        nodes = self.ray.node_ids(self.world) if setting != "ddp" else ["any"] * self.world
        (device_bytes,) = all_reduce(
            [device_memory_bytes(self.device, self.ray.local_world_size)], self.device, "min"
        )
        params = self.model.num_params(non_embedding=False)
        previous = self.spec.checkpoint_strategy
        layout, estimate = choose_layout(
            self.cfg.parallel, nodes, params, int(device_bytes), previous
        )
        if setting != "ddp":
            how = "resumed as checkpointed" if previous else "chosen"
            announce(
                f"parallel.strategy={layout.strategy}"
                + (f" ({how} by auto)" if setting == "auto" else "")
                + f", {layout.describe()}: {estimate.describe()}",
                self.is_chief,
            )
        return layout

    def _initial_plan(self) -> BatchPlan:
        """Equal shares, or shares by type weights (`scaling.balance`); `auto` starts equal
        and re-plans once it has measured (see `_rebalance`)."""
        setting, training = self.cfg.scaling.balance, self.cfg.training
        if setting == "none":
            return BatchPlan.derive(training, self.data_world)
        if setting == "auto" and self.sharded:  # strategy auto chose FSDP in the workers
            raise UserError(BALANCE_AUTO_UNDER_FSDP)
        weights = [1.0] * self.world if setting == "auto" else type_weights(setting, self.types)
        return BatchPlan.derive(training, self.world, weights, same_passes=self.sharded)

    # ------------------------------------------------------------------------------ restore

    def restore(self, offered) -> None:
        """Loads the newest checkpoint that verifies and loads, the same on every rank
        (restore.py)."""
        candidates: list[str] = list(self.run_dir.checkpoint_folders())
        if offered is not None and not self.run_dir.remote and Path(offered.path).is_dir():
            candidates.append(offered.path)  # normally one of the run directory's own
        restored, self.state = restore_group(
            candidates,
            self.model,
            self.checkpointed_optimizer,
            self.device,
            self.rank,
            self.strategy,
            self.cfg.checkpoint.restore_wait_s,
        )
        if restored is None and self.spec.expect_checkpoint:
            raise UserError(
                f"run '{self.cfg.name}' has checkpoints in {self.run_dir} but none can be "
                "restored; refusing to start from step 0 (remove the run directory to start "
                "afresh)"
            )
        if self.state.position != self.state.step * self.plan.global_batch:
            raise RuntimeError(
                f"inconsistent checkpoint: position {self.state.position}, step {self.state.step}"
            )
        self.throughput = Throughput(first_step=self.state.step)
        self.last_report_step = self.state.step

    def start(self) -> None:
        """Records this worker group's start (events, ledger, first metrics) and announces it."""
        state, plan = self.state, self.plan
        # Each rank's price in its own slot: ranks of one type may sit on spot and on-demand.
        mine = [self.my_price * (r == self.rank) for r in range(self.world)]
        self.prices = all_reduce(mine, self.device)
        group_price, unpriced = sum(self.prices), sum(price == 0 for price in self.prices)
        if unpriced and self.cfg.budget.max_usd is not None:  # it would cost nothing: refuse
            raise UserError(
                f"budget.max_usd: fault.price_per_hour gives no price for {int(unpriced)} of the "
                f"workers' types ({sorted(set(self.types))}); add them, or a `default`"
            )
        self.group_price = group_price
        world_size = self.plan.world_size * self.layout.tensor  # replica groups: the groups
        if self.is_chief:
            if self.cfg.training.ledger:
                ledger.discard_after(self.run_dir, state.step)
            close_previous_segment(self.run_dir)
            if self.cfg.budget.max_usd or self.cfg.budget.deadline:
                self.budget = BudgetGuard(self.cfg.budget, self.run_dir, self.end_step)
            if self.cfg.checkpoint.every_steps == "auto":
                self.interruptions = observed_interruptions(self.run_dir)
            self.heartbeats = HeartbeatWriter(self.run_dir)
            self.events = [
                append_event(
                    self.run_dir,
                    "segment_start",
                    segment=self.segment,
                    t_start=self.t_start,
                    t_restored=time.time(),
                    restored_step=state.step,
                    world_size=world_size,
                    layout=self.layout.describe(),
                    accumulation=plan.accumulation,
                    shares=list(plan.shares),
                    types=self.types,
                    price_per_hour=group_price,
                    nodes=sorted(self.ray.alive_node_ids()),  # lets a failure tell a lost node
                )
            ]
            origin = f"resumed at step {state.step} ({state.tokens:,} tokens)"
            announce(
                f"{origin if state.step else 'started'}; world size {world_size}, "
                + plan.describe()
            )
        self.tracker.log_metrics(
            {"world_size": plan.world_size, "accumulation_steps": plan.accumulation}
            | self._plan_metrics(),
            step=state.step,
        )

    # ------------------------------------------------------------------------------ train

    def _prepare_loop(self, step: int | None = None) -> None:
        """What the loop steps with: the model as it trains, the data stream from `step` (the
        current one if None), the evaluator."""
        self.parts, self.batches = self._step_parts(), self._batches(step=step)
        self.evaluate = self._evaluator()

    def train(self) -> None:
        state, every = self.state, self.every
        if self.parts is None:  # replica groups prepare it before they join (replicas.py)
            self._prepare_loop()
        evaluate, progress = self.evaluate, self._progress()
        self.forced_reads = self._forced_reads()
        if self.clock is not None:
            self._measure_after_warmup(first_plan=True)
        self.watchdog.start()
        self.pending.restart_clock()
        if self.sync_counter is not None:
            self.sync_counter.reset()  # restoring and starting read values: not steps
        while state.step < self.end_step:
            self._take_step(self.parts, self.batches)
            flags = self._share_flags()
            last = state.step == self.end_step
            if every.heartbeat.due(state.step, self.end_step):
                self._heartbeat()
            log_due = every.log.due(state.step, self.end_step)
            eval_due = every.eval.due(state.step, self.end_step)
            checkpoint_due = every.checkpoint.due(state.step, self.end_step)
            ends = flags.raised and not last and self._ends_group(flags)
            if self.sync_counter is not None:
                self.sync_counter.close_step(state.step)
            self.regular_read = log_due or eval_due or checkpoint_due  # every group reads
            reads = self.regular_read or ends
            if not reads and state.step not in self.forced_reads:
                continue  # nothing read: the host goes on queueing the next step
            metrics = self._read_pending()
            if log_due and self.events:
                metrics.update(self._live_goodput())
            if eval_due:
                state.val_loss, state.val_step = evaluate(self.model), state.step
                metrics["val/loss"] = state.val_loss
                self._restart_step_clock()  # evaluation time is not step time
            self.tracker.log_metrics(metrics, step=state.step)
            if progress is not None:
                progress.update(state.step, metrics, force=log_due or "val/loss" in metrics)
            if ends:
                self._report_checkpoint(final=True)
                break
            if checkpoint_due:
                self._report_checkpoint(final=last)
                self._restart_step_clock()
            if self.clock is not None and not last:
                measured = state.step - self.measured_from
                if measured == 0:
                    self.clock.take()  # the warm-up's forwards: not this device's steady pace
                elif measured == MEASURE_STEPS or (checkpoint_due and measured > MEASURE_STEPS):
                    self._rebalance(first=self.first_plan and measured == MEASURE_STEPS)
            if self.sync_counter is not None:
                self.sync_counter.close_read(state.step)
        if self.heartbeats is not None:
            self.heartbeats.close(self._beat())
        self.watchdog.stop()
        if self.sync_counter is not None and self.is_chief:
            self._event("host_syncs", **self.sync_counter.summary())
        self.tracker.flush()

    def _forced_reads(self) -> set[int]:
        """Reads at a group's first step and at the end of its warm-up, so that neither the
        start-up nor the warm-up steps blur a steady interval's tokens/s."""
        return {self.state.step + 1, self.state.step + WARMUP_STEPS}

    def _lr(self, step: int) -> float:
        optim = self.cfg.optim
        return learning_rate(step, optim.lr, optim.min_lr, optim.warmup_steps, self.decay_steps)

    def _take_step(self, parts: StepParts, batches) -> None:
        cfg, state = self.cfg, self.state
        self.tick = time.perf_counter()
        torch.manual_seed(step_seed(cfg.training.seed, state.step, self.data_rank))
        lr = self._lr(state.step)
        result = train_step(parts, batches, lr)
        state.step += 1
        state.tokens += self.tokens_per_step
        state.position += self.plan.global_batch
        if cfg.training.ledger and self.layout.tensor_rank(self.rank) == 0:
            self.ledger.append(result.positions)
        host_metrics = {"train/lr": lr, "progress/tokens": state.tokens}
        self.pending.add(
            state.step, result.loss, result.grad_norm, host_metrics, result.data_wait_s
        )
        self.watchdog.beat()
        self.pacer.pace(self.tick)

    def _share_flags(self) -> Flags:
        """Rank 0's signal flags (whether to ask Ray about preemption, whether a stop was
        requested), carried to every rank each step without waiting for the device."""
        ask = self.is_chief and self.every.signals.due(self.state.step, self.end_step)
        stop = ask and (stop_requests.stop_requested(self.run_dir) or self._chief_stops())
        asks, stops = self.flag_channel.share([int(ask), int(stop)])
        return Flags(ask=asks > 0, stop=stops > 0)

    def _read_pending(self) -> dict[str, float]:
        """Reads the steps queued since the last read (every rank at the same step): logs
        all but the newest, and returns the newest's metrics with the interval's speed."""
        interval: Interval = self.pending.read()
        *earlier, (step, metrics) = interval.steps
        for earlier_step, earlier_metrics in earlier:
            self.tracker.log_metrics(earlier_metrics, step=earlier_step)
        self.train_loss = metrics["train/loss"]
        steps, seconds = len(interval.steps), max(interval.seconds, 1e-9)
        self.throughput.add(step, seconds, steps * self.tokens_per_step, steps)
        if step == self.throughput.first_step + 1 and self.events:
            self.events.append(self._event("first_step", segment=self.segment))
        tokens_per_s = steps * self.tokens_per_step / seconds
        metrics.update(
            {
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": devices.group_mfu(
                    self.flops_per_token, tokens_per_s, self._peaks(self.types)
                ),
                "perf/step_time_s": seconds / steps,
                "perf/data_wait_fraction": min(1.0, interval.data_wait_s / seconds),
            }
        )
        if self.budget is not None:
            now, step_s = time.time(), seconds / steps
            metrics |= self.budget.metrics(self.events, now, step, step_s, self.group_price)
        if self.device.type == "cuda":  # the caching allocator's count: no device sync
            peak = torch.cuda.max_memory_allocated(self.device)
            metrics["perf/memory_peak_gib"] = peak / 2**30
        if self.is_chief:
            for kind, figures in self._per_type(tokens_per_s).items():
                for name in ("tokens_per_s", "mfu", "usd_per_mtok"):
                    if name in figures:
                        metrics[f"perf/{kind}/{name}"] = figures[name]
        return metrics

    def _per_type(self, tokens_per_s: float) -> dict[str, dict[str, float]]:
        types, prices = self._roster_of_shares()
        if len(types) != len(self.plan.shares):
            return {}
        return per_type_metrics(
            types, self.plan.shares, tokens_per_s, self.flops_per_token, prices, self._peaks(types)
        )

    def _peaks(self, types: list[str]) -> list[float]:
        """The peak FLOP/s of the device each rank of `types` trains on: the one definition
        behind every MFU figure (the progress line's, the per-type ones, the summary's)."""
        return devices.training_peaks(types, self.device, self.types[self.rank])

    def _roster_of_shares(self) -> tuple[list[str], list[float]]:
        """The accelerator type and hourly price (0: none given) of each share of the plan."""
        return self.types, self.prices

    def _live_goodput(self) -> dict[str, float]:
        live = summarize(self.events, time.time())
        live.step_s += self.throughput.step_seconds
        return live.metrics(self.state.tokens, self.tokens_per_step)

    def _restart_step_clock(self) -> None:
        self.pending.restart_clock()
        self.watchdog.beat()

    # ------------------------------------------------------------------------------ parts

    def _step_parts(self) -> StepParts:
        model = self.model
        if not self.sharded:  # sharded: compiled per block and wrapped in place already
            model = replicate_model(model, self.device, self.world)
            if self.compile:  # around DDP, so that gradient buckets overlap the backward
                model = torch.compile(model)
        return StepParts(
            model, self.model, self.optimizer, self.plan, self.data_rank, self.device, self.bf16,
            self.cfg.optim.grad_clip, clock=self.clock,
        )  # fmt: skip

    def _evaluator(self) -> Evaluator:
        cfg = self.cfg
        return Evaluator(
            data_dir=self.spec.data_dir,
            manifest=self.manifest,
            seq_len=cfg.model.block_size,
            sequences=cfg.training.eval_sequences,
            batch=self.plan.micro_batch,
            rank=self.data_rank,
            world=self.data_world,
            device=self.device,
            bf16=self.bf16,
            same_count_on_every_rank=self.sharded,
        )

    def _batches(self, part: WorkerSlice | None = None, step: int | None = None):
        """This rank's share of every step from `step` on (the current one if None; `part`:
        another slice)."""
        cfg = self.cfg
        part = part or WorkerSlice(
            self.data_rank, self.data_world, self.plan.global_batch, self.plan.shares
        )
        order = SequenceOrder(
            [s.tokens for s in self.manifest.splits["train"].shards],
            cfg.model.block_size,
            cfg.data.seed,
            cfg.data.shuffle_window_shards,
        )
        return stream_train_batches(
            self.spec.data_dir,
            self.manifest,
            order,
            part,
            part.per_rank,
            self.state.step if step is None else step,
            self.end_step,
            read_cpus=self.spec.read_cpus,
        )

    def _beat(self) -> Heartbeat:
        # Step time is counted at reads; the interval since the last one is step time too.
        seconds = self.throughput.step_seconds + (self.pending.elapsed() if self.pending else 0.0)
        return Heartbeat(self.segment, self.state.step, time.time(), seconds)

    def _heartbeat(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.put(self._beat())

    @property
    def checkpointed_optimizer(self) -> Any:  # what a checkpoint holds of the optimizers
        return self.optimizer

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return append_event(self.run_dir, kind, **fields)
