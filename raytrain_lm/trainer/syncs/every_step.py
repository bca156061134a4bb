"""`parallel.sync=every_step`: every step's gradients are averaged over the whole run's workers
before the update, whatever the group: in the backward (DDP, FSDP) in a static group, over the
step's participants and with their commit vote in replica groups (groups/replica_step.py). A
step that does not commit is taken again, with the same positions."""

from __future__ import annotations

import time

import torch

from raytrain_lm.trainer.components.cadence import Cadences, Flags
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.state import StepRecord
from raytrain_lm.trainer.components.step import accumulate_gradients, apply_update, step_seed
from raytrain_lm.trainer.progress import announce


class EveryStep:
    def __init__(self, parts: LoopParts, group):
        self.parts, self.group = parts, group

    def advance(self) -> list[StepRecord]:
        """One step, taken again until it commits."""
        parts, group = self.parts, self.group
        waited = 0.0
        while True:
            step = parts.progress.step
            step_parts, seed_rank = group.begin_step(step)
            step = parts.progress.step  # a group that healed is at its peer's step now
            taking = time.perf_counter()
            positions, tokens = group.take(step)
            started = time.perf_counter()
            waited += started - taking
            torch.manual_seed(step_seed(parts.cfg.training.seed, step, seed_rank))
            lr = parts.trainee.lr(step)
            loss = accumulate_gradients(step_parts, tokens)
            summed = group.exchange(step_parts.model, loss, positions)
            grad_norm, committed = apply_update(step_parts, lr, group.vote)
            if committed:
                break
            announce(f"step {step + 1} did not commit (a group was lost): taking it again")
        settled = group.settle(summed, positions.copy(), loss)
        parts.after_step(started)
        return [StepRecord(lr, settled.loss, grad_norm, settled.positions, waited, settled.metrics)]

    # The loop's other questions, which rounds answer otherwise (rounds.py).
    @property
    def optimizer_state(self) -> torch.optim.Optimizer:
        return self.parts.trainee.optimizer

    def cadences(self, every: Cadences) -> Cadences:
        return every

    def on_manager(self, manager) -> None:
        pass

    def after_join(self) -> None:
        pass

    def flags(self, group, step: int) -> Flags:
        """The group's: a stop request, a spot notice (each group asks on its own clock)."""
        return group.flags(step)

    def ends(self, ends: bool) -> bool:
        return ends

    def metrics(self) -> dict[str, float]:
        return {}

    def before_emergency_checkpoint(self) -> None:
        pass
