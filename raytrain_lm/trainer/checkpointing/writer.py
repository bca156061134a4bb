"""Checkpoints as a worker group writes them: the ledger of positions consumed since the last
one, the checkpoint itself (its rank's shards, or the whole state from the chief), reported to
Ray Train or uploaded by the replica groups' chief (the group says which: `publish`), pruned;
and `checkpoint.every_steps=auto`'s interval, chosen from what the saves and the steps cost.

Periodic checkpoints upload in the background while training goes on (a bucket may take
minutes for a large one); the one a worker group ends with (the last step, a stop, a spot
notice) is uploaded before the group ends, within a spot notice's deadline."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from raytrain_lm.checkpoints import prune_checkpoints, save_checkpoint, upload_checkpoint
from raytrain_lm.config import to_yaml
from raytrain_lm.data import ledger
from raytrain_lm.rundir import CONFIG_FILE, TOKENIZER_FILE
from raytrain_lm.tracking.models import CheckpointModel
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.checkpoint_interval import interval_steps
from raytrain_lm.trainer.components.metrics import per_type
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.distributed.collectives import all_reduce
from raytrain_lm.trainer.progress import announce


class CheckpointWriter:
    def __init__(self, parts: LoopParts, group, optimizer_state):
        """`optimizer_state`: what a checkpoint holds of the optimizers (the sync's)."""
        self.parts, self.group, self.optimizer_state = parts, group, optimizer_state

    def write(self, final: bool = False) -> None:
        """Writes the ledger and a checkpoint, and publishes both (the group says where)."""
        turn, final = self.group.checkpoint_turn(final)
        parts = self.parts
        if turn == "skip":
            return
        if turn == "forget":  # another group writes: its ledger waits for the chief's word
            parts.tracker.flush()
            return
        cfg, group, trainee, state = parts.cfg, self.group, parts.trainee, parts.progress.state
        # Metrics up to this step are stored before the checkpoint exists: a run resumed from
        # it never logs those steps again, and the worker may be stopped right after the
        # report (a resize, or Tune pausing or cloning a trial).
        parts.tracker.flush()
        throughput = parts.journal.throughput
        types, prices = group.roster()
        state.world_size, state.strategy = group.world, trainee.strategy
        state.shares = list(trainee.plan.shares)
        state.per_type = per_type(trainee, types, prices, throughput.tokens_per_s)
        state.train_loss, state.tokens_per_s = parts.progress.train_loss, throughput.tokens_per_s
        if parts.progress.ledger:
            # Positions consumed since the previous checkpoint, one object per rank and
            # interval: a restart from step k discards those starting at or after k.
            ledger.record(parts.run_dir, parts.progress.last_report_step, state.step,
                          group.rank, np.concatenate(parts.progress.ledger))  # fmt: skip
        report = {
            "step": state.step,
            "tokens": state.tokens,
            "train_loss": parts.progress.train_loss,
            "val_loss": state.val_loss,
            "tokens_per_s": throughput.tokens_per_s,
        }
        # As a model of the run: its val loss only when measured at its own step
        evaluated = state.val_step == state.step
        model = {**report, "val_loss": report["val_loss"] if evaluated else None}
        saving = time.perf_counter()
        local = self._save(final)
        save_s = time.perf_counter() - saving  # the training's pause (uploads overlap steps)
        if group.is_chief:
            parts.journal.event("checkpoint_saved", step=state.step, save_s=save_s)
        choose_interval = cfg.checkpoint.every_steps == "auto" and not final
        # A chaos test's kill after this checkpoint means after it is complete: wait for it.
        final = final or chaos.targets(parts.spec.fault, "kill-after-checkpoint", state.step)
        try:
            group.publish(report, local, wait=final,
                          upload=lambda local, name: self.upload(local, name, model))  # fmt: skip
        except OSError as exc:
            if group.upload_deadline is None:
                raise
            announce(f"the just-in-time checkpoint could not be saved in time: {exc}")
        chaos.maybe_fire(parts.spec.fault, "kill-after-checkpoint", state.step,
                          group.fault_rank, parts.run_dir)  # fmt: skip
        if choose_interval:  # after the report, which every rank reaches: no rank waits long
            self._set_interval(save_s)
        parts.progress.checkpointed()
        parts.watchdog.beat()

    def _save(self, final: bool) -> Path | None:
        """This rank's part of the checkpoint in a local folder (None: it has none), deleted
        once uploaded."""
        parts, group = self.parts, self.group
        trainee, state = parts.trainee, parts.progress.state
        texts = {TOKENIZER_FILE: trainee.tokenizer_json, CONFIG_FILE: to_yaml(parts.cfg)}
        if trainee.sharded:  # every rank writes its shards; the whole weights at the end
            from raytrain_lm.checkpoints.sharded import save_sharded_checkpoint

            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            save_sharded_checkpoint(local, trainee.model, trainee.optimizer, state, texts,
                                    group.rank, full_weights=final)  # fmt: skip
            return local
        if not group.is_chief:
            return None
        local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
        save_checkpoint(
            local, trainee.model, self.optimizer_state, state, texts,
            partially_written=lambda: chaos.maybe_fire(
                parts.spec.fault, "kill-in-checkpoint", state.step, group.fault_rank,
                parts.run_dir,
            ),
        )  # fmt: skip
        return local

    def upload(self, local: Path, name: str, model: dict) -> str:
        """The upload step of a published checkpoint (on a background thread for periodic
        ones): ours writes the marker last and rides out a bucket outage (see
        checkpoint.upload_checkpoint); the chief then logs the complete checkpoint as a model
        of the run and prunes, which in a bucket is a listing and a few requests that the
        training thread need not wait for. Returns where it went."""
        parts, group = self.parts, self.group
        destination = parts.run_dir.at(name)
        upload_checkpoint(
            local,
            destination,
            parts.cfg.checkpoint.upload_retry_s,
            deadline=group.upload_deadline,
            gather_parts=group.world if parts.trainee.sharded and group.is_chief else 0,
        )
        c = parts.cfg.checkpoint
        if group.is_chief:
            parts.tracker.log_checkpoint(CheckpointModel.of(model["step"], destination, model))
        try:
            if group.is_chief:
                prune_checkpoints(parts.run_dir, c.keep_last, c.keep_best)
        except OSError as exc:  # the bucket went away after the upload: prune next time
            announce(f"pruning old checkpoints failed, will retry at the next one: {exc}")
        return destination

    def _set_interval(self, save_s: float) -> None:
        """checkpoint.every_steps=auto (checkpoint_interval.py): every rank at the same
        checkpoint, from the slowest rank's save and step times and the chief's count of the
        run's interruptions, so that all agree on the next checkpoint's step."""
        parts, group = self.parts, self.group
        speed = parts.journal.throughput.tokens_per_s
        step_s = parts.trainee.tokens_per_step / speed if speed > 0 else 0.0  # NaN > 0: False
        rate, recovery = group.interruptions if group.is_chief else (0.0, 0.0)
        figures = [save_s, step_s, rate, recovery]
        save_s, step_s, rate, recovery = all_reduce(figures, parts.device, "max")
        step = parts.progress.step
        steps = interval_steps(save_s, step_s, rate, recovery, parts.end_step - step)
        group.agree_interval(steps, step)
        if group.is_chief:
            parts.journal.event(
                "checkpoint_interval", step=step, steps=steps, save_s=save_s, step_s=step_s,
                rate_per_hour=rate * 3600, recovery_s=recovery,
            )  # fmt: skip
            announce(
                f"checkpoint.every_steps=auto: every {steps} steps (save {save_s:.2f} s, step "
                f"{step_s:.3f} s, {rate * 3600:.3f} interruptions per hour, recovery "
                f"{recovery:.0f} s)"
            )
