"""One worker's training run: the loop, and the parts it steps with.

The loop is the same whatever the run's mode. What differs is chosen once, in entry.py, and
handed in as two components, each built from its own settings:
- the group (`scaling.fault_tolerance`): who this worker trains with, how it restores, what
  ends it, where its checkpoints go. A static Ray Train group (groups/static.py), or a torchft
  replica group that others join and leave (groups/replicas.py);
- the sync (`parallel.sync`): what one advance of the loop trains and when groups exchange.
  Every step (syncs/every_step.py), or rounds of DiLoCo or LocalSGD (syncs/rounds.py).
Each advance hands back the steps it committed, and `RunProgress.advance` is the one place the
run moves on. Then what the step is due (cadence.py): a heartbeat, a read of the metrics,
evaluation, a checkpoint, the stop and spot-notice protocol. Pure PyTorch and files: what the
loop needs of Ray it asks of a `RaySide` (ray_side.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.writer import CheckpointWriter
from raytrain_lm.trainer.components.batch_plan import end_step
from raytrain_lm.trainer.components.cadence import Cadences
from raytrain_lm.trainer.components.evaluation import Evaluator
from raytrain_lm.trainer.components.journal import Journal
from raytrain_lm.trainer.components.metrics import StepMetrics
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.pending_values import PendingSteps
from raytrain_lm.trainer.components.state import RunProgress
from raytrain_lm.trainer.components.watchdog import StepWatchdog

if TYPE_CHECKING:
    from raytrain_lm.trainer.ray_side import RaySide
    from raytrain_lm.trainer.spec import WorkerSpec


class Worker:
    """One worker's run: the parts it trains with, its group and sync, and the loop."""

    def __init__(self, spec: WorkerSpec, ray: RaySide, group, make_sync, t_start: float):
        cfg = spec.config
        trainee = group.build_trainee(spec, ray.device)
        chaos.simulate_device(trainee.model, spec.fault, group.fault_rank)
        pending = PendingSteps(group.world, loss_copies=trainee.layout.tensor)
        self.group = group
        self.parts = parts = LoopParts(
            spec=spec,
            ray=ray,
            trainee=trainee,
            progress=RunProgress(cfg.training.global_batch_size, trainee.tokens_per_step, pending),
            journal=Journal(spec.run_dir, t_start),
            tracker=group.tracker(),
            every=Cadences.of(cfg),
            watchdog=StepWatchdog(cfg.fault.step_timeout_s),
            pacer=chaos.Pacer(spec.fault, spec.run_dir),
            end_step=end_step(cfg.training),
        )
        group.attach(parts)
        self.sync = make_sync(parts, group)  # after the model: DiLoCo's outer optimizers
        parts.every = self.sync.cadences(parts.every)
        parts.optimizer_state = self.sync.optimizer_state
        self.checkpoints = CheckpointWriter(parts, group, parts.optimizer_state)
        self.metrics = StepMetrics(parts, group, self.sync)
        self.host_syncs = chaos.sync_counter(spec.fault, trainee.device)

    def prepare(self, step: int | None = None) -> None:
        """What the loop steps with: the model as it trains, the data stream from `step` (the
        current one if None), the evaluator. Replica groups make them before they join."""
        parts, trainee, cfg = self.parts, self.parts.trainee, self.parts.cfg
        parts.step_parts = trainee.step_parts()
        parts.batches = self.group.data_stream(step)
        parts.evaluate = Evaluator(
            data_dir=parts.spec.data_dir,
            manifest=trainee.manifest,
            seq_len=cfg.model.block_size,
            sequences=cfg.training.eval_sequences,
            batch=trainee.plan.micro_batch,
            rank=trainee.data_rank,
            world=trainee.data_world,
            device=trainee.device,
            bf16=trainee.bf16,
            same_count_on_every_rank=trainee.sharded,
        )

    def run(self) -> None:
        with self.group.running(self._emergency_checkpoint):
            # Restores the newest checkpoint, or heals from a peer
            if self.group.join(self.prepare, self.sync.on_manager):
                self.sync.after_join()
                self.group.start()
                self.train()

    def train(self) -> None:
        parts, group, sync = self.parts, self.group, self.sync
        progress, every, end = parts.progress, parts.every, parts.end_step
        self._begin()
        while progress.step < end:
            for record in sync.advance():
                progress.advance(record)
            step = progress.step
            flags = sync.flags(group, step)
            if every.heartbeat.due(step, end) and group.is_chief:
                parts.journal.heartbeat(step, self._unread_s())
            reads = every.reads(step, end)
            ends = flags.raised and step != end and sync.ends(group.ends(flags))
            self.host_syncs.close_step(step)
            group.regular_read = reads.any  # every group reads then
            # Nothing to read: the host goes on queueing the next step, not waiting for it.
            read = reads.any or ends or step in self.forced_reads
            if read and self._read(reads, ends):
                break
        self._close()

    def _begin(self) -> None:
        parts, group = self.parts, self.group
        if parts.step_parts is None:
            self.prepare()
        self.bar = group.progress_bar()
        self.forced_reads = group.forced_reads(parts.progress.step)
        self.rebalancer = group.rebalancer(self.forced_reads)  # scaling.balance=auto's
        parts.watchdog.start()
        parts.progress.pending.restart_clock()
        self.host_syncs.reset()  # restoring and starting read values: not steps

    def _read(self, reads, ends: bool) -> bool:
        """The step's duties that read values: the metrics (evaluation too), then this group's
        end with a checkpoint, or a periodic checkpoint and a re-plan of the shares. Whether
        the group ends here."""
        parts, step = self.parts, self.parts.progress.step
        metrics = self.metrics.read(live_goodput=reads.log)
        if reads.eval:
            metrics["val/loss"] = self.metrics.validate()
        parts.tracker.log_metrics(metrics, step=step)
        if self.bar is not None:
            self.bar.update(step, metrics, force=reads.log or reads.eval)
        if ends:
            self.checkpoints.write(final=True)
            return True
        if reads.checkpoint:
            self.checkpoints.write(final=step == parts.end_step)
            parts.restart_step_clock()
        if self.rebalancer is not None and step != parts.end_step:
            self.rebalancer.after_read(reads.checkpoint)
        self.host_syncs.close_read(step)
        return False

    def _emergency_checkpoint(self) -> None:
        """A checkpoint outside the loop's duties (replica groups: the Lighthouse lost, too
        few groups): what is queued logged first."""
        parts = self.parts
        self.sync.before_emergency_checkpoint()
        if len(parts.progress.pending):
            parts.tracker.log_metrics(self.metrics.read(live_goodput=False),
                                      step=parts.progress.step)  # fmt: skip
        self.checkpoints.write(final=True)

    def _unread_s(self) -> float:
        """Step time not counted yet: since the last read (a heartbeat's, a closing one's)."""
        pending = self.parts.progress.pending
        return pending.elapsed() if len(pending) else 0.0

    def _close(self) -> None:
        parts = self.parts
        parts.journal.close(parts.progress.step, self._unread_s())
        parts.watchdog.stop()
        if self.host_syncs.armed and self.group.is_chief:
            parts.journal.event("host_syncs", **self.host_syncs.summary())
        parts.tracker.flush()
