"""How a worker's group ends and what it leaves behind: the stop and spot-notice protocol at a
step boundary, and checkpoints written, reported to Ray Train and uploaded (a part of Worker,
worker.py; replica groups override what differs, replicas.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from raytrain_lm.checkpoints import prune_checkpoints, save_checkpoint, upload_checkpoint
from raytrain_lm.config import to_yaml
from raytrain_lm.data import ledger
from raytrain_lm.placement import OnDemandRequests
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import CONFIG_FILE, TOKENIZER_FILE
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.checkpoint_interval import interval_steps
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.cadence import Flags
from raytrain_lm.trainer.components.spot_first import DeadlineCapacity, measured_restart_s
from raytrain_lm.trainer.distributed.collectives import all_reduce
from raytrain_lm.trainer.progress import announce


class Endings:
    """The Worker's stop, spot-notice and checkpoint methods."""

    def _ends_group(self, flags: Flags) -> bool:
        """After rank 0 raised a flag (every rank calls this at the same step): whether this
        group ends now, with a checkpoint, for a stop request or a spot notice."""
        if flags.stop:
            reason = stop_requests.STOP
            if self.is_chief:
                why = self.stop_reason
                extra = {"market": self.budget.capacity.switch_to} if why == "capacity" else {}
                self.events.append(
                    self._event(stop_requests.STOP, step=self.state.step, why=why, **extra)
                )
                if why == "budget":
                    spent = self.budget.spent(self.events, time.time())
                    announce(f"budget: ${spent:,.2f} spent, budget.max_usd reached")
        else:
            info = self.ray.preemption_info()  # a collective: every rank asks
            if info is None or not self.cfg.fault.checkpoint_on_preemption:
                return False
            # A node of ours is being drained: checkpoint now and end this group, so the
            # driver restarts at once on the nodes that stay; steps taken while waiting for
            # the node to vanish would only be recomputed.
            reason = stop_requests.PREEMPTION
            self.upload_deadline = info.deadline_ms / 1000 if info.deadline_ms else None
            if self.is_chief:
                ranks = sorted(info.preempted_ranks)
                self.events.append(
                    self._event(
                        reason, step=self.state.step, deadline_ms=info.deadline_ms, ranks=ranks
                    )
                )
                announce(f"preemption notice for ranks {ranks}")
        announce(
            f"{reason}: just-in-time checkpoint at step {self.state.step}, then this worker "
            "group ends",
            self.is_chief,
        )
        return True

    def _chief_stops(self) -> bool:
        """Rank 0: whether budget.max_usd is spent, or scaling.capacity=spot_first moves the
        run to other nodes (then the stop flag goes up, as for a stop request, and the group
        checkpoints and ends)."""
        if self.budget is None:
            return False
        if self.budget.exhausted(self.events, time.time()):
            self.stop_reason = "budget"
            return True
        if self.cfg.scaling.capacity != "spot_first" or self.state.step >= self.end_step:
            return False  # at the last step nothing is left to move (the run withdraws at exit)
        if self.budget.capacity is None:
            events = read_events(self.run_dir)
            self.budget.capacity = DeadlineCapacity(
                market=self.spec.market,
                deadline_s=self.cfg.budget.deadline_s,
                first_start=self.budget.first_start,
                end_step=self.end_step,
                max_workers=self.cfg.scaling.max_size,
                restart_s=measured_restart_s(events),
                requests=OnDemandRequests(
                    self.cfg.name, self.cfg.scaling, self.device.type == "cuda", self.types[0]
                ),
            )
        decision = self.budget.capacity.check(self.state.step, self.world)
        for note in decision.notes:
            self.events.append(self._event(note.event, **note.fields))
            announce(note.line)
        if decision.switch_to is None:
            return False
        self.stop_reason = "capacity"  # the stop event names the market (launch.py)
        return True

    def _set_checkpoint_interval(self, save_s: float) -> None:
        """checkpoint.every_steps=auto (checkpoint_interval.py): every rank at the same
        checkpoint, from the slowest rank's save and step times and rank 0's count of the
        run's interruptions, so that all agree on the next checkpoint's step."""
        speed = self.throughput.tokens_per_s
        step_s = self.tokens_per_step / speed if speed > 0 else 0.0  # NaN > 0 is False
        rate, recovery = self.interruptions if self.is_chief else (0.0, 0.0)
        figures = [save_s, step_s, rate, recovery]
        save_s, step_s, rate, recovery = all_reduce(figures, self.device, "max")
        steps = interval_steps(save_s, step_s, rate, recovery, self.end_step - self.state.step)
        self.every.checkpoint.steps, self.every.checkpoint.since = steps, self.state.step
        if self.is_chief:
            self._event(
                "checkpoint_interval", step=self.state.step, steps=steps, save_s=save_s,
                step_s=step_s, rate_per_hour=rate * 3600, recovery_s=recovery,
            )  # fmt: skip
            announce(
                f"checkpoint.every_steps=auto: every {steps} steps (save {save_s:.2f} s, step "
                f"{step_s:.3f} s, {rate * 3600:.3f} interruptions per hour, recovery "
                f"{recovery:.0f} s)"
            )

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
        local = None
        texts = {TOKENIZER_FILE: self.tokenizer_json, CONFIG_FILE: to_yaml(self.cfg)}
        saving = time.perf_counter()
        if self.sharded:  # every rank writes its shards; the whole weights at the end
            from raytrain_lm.checkpoints.sharded import save_sharded_checkpoint

            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            save_sharded_checkpoint(
                local, self.model, self.optimizer, state, texts, self.rank, full_weights=final
            )
        elif self.is_chief:
            # Deleted once it is uploaded (in the background, if async).
            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            save_checkpoint(
                local,
                self.model,
                self.checkpointed_optimizer,
                state,
                texts,
                partially_written=lambda: chaos.maybe_fire(
                    self.spec.fault, "kill-in-checkpoint", state.step, self.fault_rank, self.run_dir
                ),
            )
        save_s = time.perf_counter() - saving  # the training's pause (uploads overlap steps)
        if self.is_chief:
            self._event("checkpoint_saved", step=state.step, save_s=save_s)
        choose_interval = self.cfg.checkpoint.every_steps == "auto" and not final
        # A chaos test's kill after this checkpoint means after it is complete: wait for it.
        final = final or chaos.targets(self.spec.fault, "kill-after-checkpoint", state.step)
        try:
            self._publish_checkpoint(report, local, wait=final)
        except OSError as exc:
            if self.upload_deadline is None:
                raise
            announce(f"the just-in-time checkpoint could not be saved in time: {exc}")
        chaos.maybe_fire(
            self.spec.fault, "kill-after-checkpoint", state.step, self.fault_rank, self.run_dir
        )
        if choose_interval:  # after the report, which every rank reaches: no rank waits long
            self._set_checkpoint_interval(save_s)
        self.last_report_step = state.step
        self.ledger = []
        self.watchdog.beat()

    def _publish_checkpoint(self, report: dict[str, float], local: Path | None, wait: bool) -> None:
        """Reports the metrics and this rank's part of the checkpoint (None: none) to Ray
        Train, which uploads it with `_upload`, in the background unless `wait`."""
        self.ray.report(report, local, wait=wait, upload=self._upload)

    def _upload(self, local: Path, name: str) -> str:
        """The upload step of a reported checkpoint (on a background thread for periodic
        ones): ours writes the marker last and rides out a bucket outage (see
        checkpoint.upload_checkpoint), then prunes, which in a bucket is a listing and a few
        requests that the training thread need not wait for. Returns where it went."""
        destination = self.run_dir.at(name)
        upload_checkpoint(
            local,
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
            announce(f"pruning old checkpoints failed, will retry at the next one: {exc}")
        return destination
