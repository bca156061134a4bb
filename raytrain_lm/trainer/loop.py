"""`train_loop_per_worker`: build, restore, then step; periodic work declared in one table
(Ray's own pattern: restore first, then step, then report).

This module is the only one that calls Ray Train's per-worker API (`ray.train.get_context`,
`get_checkpoint`, `report`, `get_preemption_info`, `ray.train.torch.get_device`), beside
`eval_loop.py`, the worker function of `raytrain-lm eval` (context and device only). What it
drives is plain PyTorch and files: one optimizer step (step.py), validation (evaluation.py),
checkpoint contents (checkpoint.py), the stop and preemption protocol (signals.py), goodput
events (goodput.py). Each part gets only the settings it needs.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointUploadMode

from raytrain_lm.config import BALANCE_AUTO_UNDER_FSDP, RunConfig, to_yaml
from raytrain_lm.data import ledger
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.order import SequenceOrder
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model
from raytrain_lm.rundir import CONFIG_FILE, TOKENIZER_FILE
from raytrain_lm.storage import filesystem
from raytrain_lm.tokenization import load_tokenizer
from raytrain_lm.tracking import MLflowTracker, NullTracker, Tracker
from raytrain_lm.trainer import faults, hardware, signals
from raytrain_lm.trainer.balance import (
    MEASURE_STEPS,
    ForwardClock,
    Speeds,
    per_type_metrics,
    replan_weights,
    type_weights,
)
from raytrain_lm.trainer.cadence import Every
from raytrain_lm.trainer.callbacks import alive_node_ids
from raytrain_lm.trainer.checkpoint import (
    TrainState,
    prune_checkpoints,
    save_checkpoint,
    upload_checkpoint,
)
from raytrain_lm.trainer.collectives import FlagChannel, all_reduce, pin_gloo_interface
from raytrain_lm.trainer.evaluation import Evaluator
from raytrain_lm.trainer.goodput import (
    Heartbeat,
    HeartbeatWriter,
    append_event,
    close_previous_segment,
    summarize,
)
from raytrain_lm.trainer.parallel import (
    MemoryEstimate,
    check_fits,
    choose_strategy,
    device_memory_bytes,
    replicate_model,
    shard_model,
)
from raytrain_lm.trainer.pending import Interval, PendingSteps
from raytrain_lm.trainer.plan import BatchPlan, end_step, learning_rate
from raytrain_lm.trainer.progress import ProgressBar
from raytrain_lm.trainer.recompute import apply_activation_checkpointing
from raytrain_lm.trainer.restore import restore_group
from raytrain_lm.trainer.spec import WorkerSpec
from raytrain_lm.trainer.step import StepParts, step_seed, train_step
from raytrain_lm.trainer.storage_checks import check_worker_sees
from raytrain_lm.trainer.watchdog import StepWatchdog

HEARTBEAT_EVERY_S = 0.5
WARMUP_STEPS = 3  # the first steps of a group pay for start-up: not counted in tokens/s


def train_loop_per_worker(spec: WorkerSpec) -> None:
    t_start = time.time()
    _quiet_ray_train_info_logs()
    context = ray.train.get_context()
    pin_gloo_interface(ray.util.get_node_ip_address())  # before any gloo group (the flags')
    check_worker_sees(str(spec.run_dir), spec.data_dir, spec.config.output_dir)
    worker = Worker(spec, context.get_world_rank(), context.get_world_size(), t_start)
    worker.restore(ray.train.get_checkpoint())
    worker.start()
    worker.train()


class Worker:
    """One worker's run: what it built, where it is, and the periodic work of its loop."""

    def __init__(self, spec: WorkerSpec, rank: int, world: int, t_start: float):
        cfg = spec.config
        self.spec, self.cfg, self.rank, self.world, self.t_start = spec, cfg, rank, world, t_start
        self.device = ray.train.torch.get_device()
        hardware.configure_device(self.device)
        self.bf16 = hardware.use_bf16(self.device, cfg.training.precision)
        self.compile = hardware.use_compile(self.device, cfg.training.compile)
        self.run_dir = spec.run_dir
        self.is_chief = rank == 0  # the one rank that writes run files, events and metrics

        self.manifest = Manifest.load(spec.data_dir)
        self.tokenizer_json = load_tokenizer(spec.data_dir).to_json()
        self.end_step = end_step(cfg.training)
        torch.manual_seed(cfg.training.seed)
        self.model = build_model(cfg.model, self.manifest.vocab_size).to(self.device)
        if cfg.model.init_from:  # a restore below replaces these weights when resuming
            from raytrain_lm.huggingface import load_hf_weights

            load_hf_weights(self.model, cfg.model.init_from)
        apply_activation_checkpointing(self.model, cfg.training.activation_checkpointing)
        self.strategy = self._choose_strategy()
        if self.sharded:
            shard_model(
                self.model,
                self.device,
                world,
                self.bf16,
                cfg.parallel.reshard_after_forward,
                compile_blocks=self.compile,
            )
        self.types = _accelerator_types(world, self.device)  # each rank's, on every rank
        self.plan = self._initial_plan()
        self.optimizer = hardware.build_adamw(
            self.model.optimizer_groups(cfg.optim.weight_decay),
            cfg.optim.lr,
            (cfg.optim.beta1, cfg.optim.beta2),
            self.device,
        )
        self.tracker: Tracker = NullTracker()
        if self.is_chief and spec.tracking is not None:
            self.tracker = MLflowTracker(spec.tracking.uri, spec.tracking.run_id)
        self.flops_per_token = self.model.flops_per_token()
        self.tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
        self.decay_steps = cfg.optim.decay_steps or cfg.training.max_steps
        self.every = Cadences.of(cfg)
        self.watchdog = StepWatchdog(cfg.fault.step_timeout_s)
        self.flag_channel = FlagChannel(self.device, cfg.fault.collective_timeout_s)
        self.pending = PendingSteps(world)
        self.sync_counter = faults.sync_counter(spec.fault, self.device)
        self.clock = ForwardClock(self.device) if cfg.scaling.balance == "auto" else None
        faults.simulate_device(self.model, spec.fault, rank)
        self.pacer = faults.Pacer(spec.fault, self.run_dir)

        self.state = TrainState()
        self.segment = uuid.uuid4().hex[:12]
        self.events: list[dict[str, Any]] = []
        self.throughput = Throughput(first_step=0)
        self.ledger: list[np.ndarray] = []  # positions consumed since the last checkpoint
        self.last_report_step = 0
        self.upload_deadline: float | None = None  # a spot notice's deadline (wall clock)
        self.heartbeats: HeartbeatWriter | None = None  # rank 0's, from start()
        self.train_loss = float("nan")
        self.tick = time.perf_counter()  # when this step began, on the host (for pacing)

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def _choose_strategy(self) -> str:
        """parallel.strategy, with `auto` settled from the memory the group's state needs
        against its smallest device; the same on every rank."""
        setting = self.cfg.parallel.strategy
        local_workers = ray.train.get_context().get_local_world_size()
        (device_bytes,) = all_reduce(
            [device_memory_bytes(self.device, local_workers)], self.device, "min"
        )
        estimate = MemoryEstimate(
            params=self.model.num_params(non_embedding=False),
            world=self.world,
            device_bytes=int(device_bytes),
            fraction=self.cfg.parallel.auto_state_fraction,
        )
        strategy = choose_strategy(setting, estimate, self.spec.checkpoint_strategy)
        check_fits(strategy, estimate)
        if setting == "auto" or strategy == "fsdp":
            how = "resumed as checkpointed" if self.spec.checkpoint_strategy else "chosen"
            _announce(
                f"parallel.strategy={strategy}"
                + (f" ({how} by auto)" if setting == "auto" else "")
                + f": {estimate.describe()}",
                self.is_chief,
            )
        return strategy

    def _initial_plan(self) -> BatchPlan:
        """Equal shares, or shares by type weights (`scaling.balance`); `auto` starts equal
        and re-plans once it has measured (see `_rebalance`)."""
        setting, training = self.cfg.scaling.balance, self.cfg.training
        if setting == "none":
            return BatchPlan.derive(training, self.world)
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
            self.optimizer,
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
        prices, my_type = self.cfg.fault.price_per_hour, self.types[self.rank]
        my_price = hardware.by_accelerator_type(prices, my_type) or 0.0
        group_price = all_reduce([my_price], self.device)
        if self.is_chief:
            if self.cfg.training.ledger:
                ledger.discard_after(self.run_dir, state.step)
            close_previous_segment(self.run_dir)
            self.heartbeats = HeartbeatWriter(self.run_dir)
            self.events = [
                append_event(
                    self.run_dir,
                    "segment_start",
                    segment=self.segment,
                    t_start=self.t_start,
                    t_restored=time.time(),
                    restored_step=state.step,
                    world_size=self.world,
                    accumulation=plan.accumulation,
                    shares=list(plan.shares),
                    types=self.types,
                    price_per_hour=group_price[0],
                    nodes=sorted(alive_node_ids()),  # lets a failure tell a lost node
                )
            ]
            origin = f"resumed at step {state.step} ({state.tokens:,} tokens)"
            _announce(
                f"{origin if state.step else 'started'}; world size {self.world}, "
                + plan.describe()
            )
        self.tracker.log_metrics(
            {"world_size": self.world, "accumulation_steps": plan.accumulation}
            | self._plan_metrics(),
            step=state.step,
        )

    # ------------------------------------------------------------------------------ train

    def train(self) -> None:
        state, every = self.state, self.every
        self.parts, self.batches, evaluate = self._step_parts(), self._batches(), self._evaluator()
        progress = None
        if self.is_chief and self.cfg.training.progress:
            progress = ProgressBar(self.end_step, state.step, self.cfg.training.log_every)
        # Reads at a group's first step and at the end of its warm-up, so that neither the
        # start-up nor the warm-up steps blur a steady interval's tokens/s.
        self.forced_reads = {state.step + 1, state.step + WARMUP_STEPS}
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
            reads = log_due or eval_due or checkpoint_due or ends
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
                progress.update(state.step, metrics, force="val/loss" in metrics)
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

    def _take_step(self, parts: StepParts, batches) -> None:
        cfg, state = self.cfg, self.state
        self.tick = time.perf_counter()
        torch.manual_seed(step_seed(cfg.training.seed, state.step, self.rank))
        lr = learning_rate(
            state.step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, self.decay_steps
        )
        result = train_step(parts, batches, lr)
        state.step += 1
        state.tokens += self.tokens_per_step
        state.position += self.plan.global_batch
        if cfg.training.ledger:
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
        stop = ask and signals.stop_requested(self.run_dir)
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
                "perf/mfu": hardware.mfu(
                    self.flops_per_token, tokens_per_s / self.world, self.device
                ),
                "perf/step_time_s": seconds / steps,
                "perf/data_wait_fraction": min(1.0, interval.data_wait_s / seconds),
            }
        )
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
        return per_type_metrics(
            self.types,
            self.plan.shares,
            tokens_per_s,
            self.flops_per_token,
            self.cfg.fault.price_per_hour,
        )

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
            _announce(
                f"balance at step {self.state.step} ({reason}: the slowest rank's forwards took "
                f"{imbalance:.0%} over the mean; sequences/s {rates}): {plan.describe()}"
            )
        self.tracker.log_metrics(self._plan_metrics(), step=self.state.step)
        self._restart_step_clock()
        self.throughput.restart_steady(self.state.step)  # tokens/s of the plan now in use
        self._measure_after_warmup(first_plan=False)

    def _plan_metrics(self) -> dict[str, float]:
        return {f"plan/rank{r}_share": float(n) for r, n in enumerate(self.plan.shares)}

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
            model, self.model, self.optimizer, self.plan, self.rank, self.device, self.bf16,
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
            rank=self.rank,
            world=self.world,
            device=self.device,
            bf16=self.bf16,
            same_count_on_every_rank=self.sharded,
        )

    def _batches(self):
        cfg = self.cfg
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
            WorkerSlice(self.rank, self.world, self.plan.global_batch, self.plan.shares),
            self.plan.shares[self.rank],
            self.state.step,
            self.end_step,
            read_cpus=self.spec.read_cpus,
        )

    def _ends_group(self, flags: Flags) -> bool:
        """After rank 0 raised a flag (every rank calls this at the same step): whether this
        group ends now, with a checkpoint, for a stop request or a spot notice."""
        if flags.stop:
            reason = signals.STOP
            if self.is_chief:
                self.events.append(self._event(signals.STOP, step=self.state.step))
        else:
            info = ray.train.get_preemption_info()  # a collective: every rank asks
            if info is None or not self.cfg.fault.checkpoint_on_preemption:
                return False
            # A node of ours is being drained: checkpoint now and end this group, so the
            # driver restarts at once on the nodes that stay; steps taken while waiting for
            # the node to vanish would only be recomputed.
            reason = signals.PREEMPTION
            self.upload_deadline = info.deadline_ms / 1000 if info.deadline_ms else None
            if self.is_chief:
                ranks = sorted(info.preempted_ranks)
                self.events.append(
                    self._event(
                        reason, step=self.state.step, deadline_ms=info.deadline_ms, ranks=ranks
                    )
                )
                _announce(f"preemption notice for ranks {ranks}")
        _announce(
            f"{reason}: just-in-time checkpoint at step {self.state.step}, then this worker "
            "group ends",
            self.is_chief,
        )
        return True

    def _report_checkpoint(self, final: bool = False) -> None:
        """Writes the ledger and a checkpoint, and reports both to Ray Train.

        Periodic checkpoints upload in the background while training goes on (a bucket may
        take minutes for a large one); the one a worker group ends with (the last step, a
        stop, a spot notice) is uploaded before the group ends, within a spot notice's
        deadline."""
        state = self.state
        # Metrics up to this step are stored before the checkpoint exists: a run resumed from
        # it never logs those steps again, and the worker may be stopped right after the
        # report (a resize, or Tune pausing or cloning a trial).
        self.tracker.flush()
        state.world_size, state.strategy = self.world, self.strategy
        state.shares = list(self.plan.shares)
        state.per_type = self._per_type(self.throughput.tokens_per_s)
        state.train_loss, state.tokens_per_s = self.train_loss, self.throughput.tokens_per_s
        if self.ledger:
            # Positions consumed since the previous checkpoint, one object per rank and
            # interval: a restart from step k discards those starting at or after k.
            ledger.record(
                self.run_dir, self.last_report_step, state.step, self.rank,
                np.concatenate(self.ledger),
            )  # fmt: skip
        report = {
            "step": state.step,
            "tokens": state.tokens,
            "train_loss": self.train_loss,
            "val_loss": state.val_loss,
            "tokens_per_s": self.throughput.tokens_per_s,
        }
        checkpoint = None
        texts = {TOKENIZER_FILE: self.tokenizer_json, CONFIG_FILE: to_yaml(self.cfg)}
        if self.sharded:  # every rank writes its shards; the whole weights at the end
            from raytrain_lm.trainer.sharded import save_sharded_checkpoint

            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            save_sharded_checkpoint(
                local, self.model, self.optimizer, state, texts, self.rank, full_weights=final
            )
            checkpoint = ray.train.Checkpoint.from_directory(str(local))
        elif self.is_chief:
            # Ray deletes this folder once it is uploaded (in the background, if async).
            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            save_checkpoint(
                local,
                self.model,
                self.optimizer,
                state,
                texts,
                partially_written=lambda: faults.maybe_fire(
                    self.spec.fault, "kill-in-checkpoint", state.step, self.rank, self.run_dir
                ),
            )
            checkpoint = ray.train.Checkpoint.from_directory(str(local))
        # A chaos test's kill after this checkpoint means after it is complete: wait for it.
        final = final or faults.targets(self.spec.fault, "kill-after-checkpoint", state.step)
        mode = CheckpointUploadMode.SYNC if final else CheckpointUploadMode.ASYNC
        try:
            ray.train.report(
                report,
                checkpoint=checkpoint,
                checkpoint_upload_mode=mode,
                checkpoint_upload_fn=self._upload,
                delete_local_checkpoint_after_upload=True,
            )
        except OSError as exc:
            if self.upload_deadline is None:
                raise
            _announce(f"the just-in-time checkpoint could not be saved in time: {exc}")
        faults.maybe_fire(
            self.spec.fault, "kill-after-checkpoint", state.step, self.rank, self.run_dir
        )
        self.last_report_step = state.step
        self.ledger = []
        self.watchdog.beat()

    def _upload(self, checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
        """Ray Train's upload step (on a background thread for periodic checkpoints): ours
        writes the marker last and rides out a bucket outage (see
        checkpoint.upload_checkpoint), then prunes, which in a bucket is a listing and a few
        requests that the training thread need not wait for."""
        destination = self.run_dir.at(name)
        upload_checkpoint(
            Path(checkpoint.path),
            destination,
            self.cfg.checkpoint.upload_retry_s,
            deadline=self.upload_deadline,
            gather_parts=self.world if self.sharded and self.is_chief else 0,
        )
        c = self.cfg.checkpoint
        try:
            if self.is_chief:
                prune_checkpoints(self.run_dir, c.keep_last, c.keep_best)
        except OSError as exc:  # the bucket went away after the upload: prune next time
            _announce(f"pruning old checkpoints failed, will retry at the next one: {exc}")
        fs, inner = filesystem(destination)
        return ray.train.Checkpoint(inner, filesystem=fs)

    def _beat(self) -> Heartbeat:
        # Step time is counted at reads; the interval since the last one is step time too.
        seconds = self.throughput.step_seconds + (self.pending.elapsed() if self.pending else 0.0)
        return Heartbeat(self.segment, self.state.step, time.time(), seconds)

    def _heartbeat(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.put(self._beat())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return append_event(self.run_dir, kind, **fields)


@dataclass(frozen=True)
class Flags:
    ask: bool  # rank 0's clock says: ask Ray whether one of our nodes is being drained
    stop: bool  # the driver asked the run to stop

    @property
    def raised(self) -> bool:
        return self.ask or self.stop


@dataclass(frozen=True)
class Cadences:
    """When each periodic part of the loop runs: all of them, in one place."""

    heartbeat: Every  # rank 0's liveness record for goodput (seconds)
    signals: Every  # rank 0 looks for a stop request and asks about preemption (seconds)
    log: Every  # progress line and live goodput metrics (steps); step metrics: every step
    eval: Every  # validation loss (steps, and the last step)
    checkpoint: Every  # checkpoint + report to Ray Train (steps, and the last step)

    @classmethod
    def of(cls, cfg: RunConfig) -> Cadences:
        return cls(
            heartbeat=Every(seconds=HEARTBEAT_EVERY_S),
            signals=Every(seconds=cfg.fault.preemption_check_s),
            log=Every(steps=cfg.training.log_every, at_end=True),
            eval=Every(steps=cfg.training.eval_every, at_end=True),
            checkpoint=Every(steps=cfg.checkpoint.every_steps, at_end=True),
        )


class Throughput:
    """Tokens per second over this group's steps, leaving out the first few (start-up)."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.step_seconds = 0.0  # every step of this group, for goodput
        self._steady_from = first_step
        self._tokens, self._seconds = 0, 0.0
        self._last = float("nan")

    def add(self, step: int, seconds: float, tokens: int, steps: int = 1) -> None:
        """An interval of `steps` steps ending at `step`."""
        self.step_seconds += seconds
        self._last = tokens / seconds
        if step - steps >= self._steady_from + WARMUP_STEPS:
            self._tokens += tokens
            self._seconds += seconds

    def restart_steady(self, step: int) -> None:
        """From `step` on the group runs at another pace (a new batch plan): count that one."""
        self._steady_from = step
        self._tokens, self._seconds = 0, 0.0

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds else self._last


def _announce(message: str, chief: bool = True) -> None:
    # The real stdout: Ray Train's patched print would echo a line twice once another library
    # (MLflow) has wrapped sys.stdout.
    if chief:
        print(f"[raytrain-lm] {message}", file=sys.__stdout__, flush=True)


def _accelerator_types(world: int, device: torch.device) -> list[str]:
    """Every rank's accelerator type, in rank order (a collective)."""
    mine = _node_accelerator_type()
    if mine == "cpu" and device.type == "cuda":  # a GPU node without Ray's type resource
        mine = torch.cuda.get_device_name(device)
    if world == 1 or not dist.is_initialized():
        return [mine]
    types: list[str | None] = [None] * world
    dist.all_gather_object(types, mine)
    return [str(t) for t in types]


def _node_accelerator_type() -> str:
    """This worker's node's accelerator type from its Ray resources (`cpu` if none)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            for name in node.get("Resources", {}):
                if name.startswith("accelerator_type:"):
                    return name.split(":", 1)[1]
    return "cpu"


def _quiet_ray_train_info_logs() -> None:
    # Ray Train logs every report and checkpoint at INFO from loggers named by file path,
    # which LoggingConfig does not reach; our progress line already says the same.
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)
