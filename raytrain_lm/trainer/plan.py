"""How a configured global batch maps onto the current world size. Recomputed at every start."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config import TrainingConfig
from raytrain_lm.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch: int  # sequences per optimizer step, all workers together
    micro_batch: int  # sequences per worker per forward pass
    accumulation: int  # forward passes per worker per step

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation

    @classmethod
    def derive(cls, cfg: TrainingConfig, world_size: int) -> BatchPlan:
        g = cfg.global_batch_size
        if g % world_size:
            raise UserError(
                f"training.global_batch_size ({g}) is not divisible by the world size ({world_size})"
            )
        per_rank = g // world_size
        micro = cfg.micro_batch_size or per_rank
        if per_rank % micro:
            raise UserError(
                f"training.global_batch_size ({g}) is not divisible by world size ({world_size})"
                f" x training.micro_batch_size ({micro})"
            )
        return cls(world_size, g, micro, per_rank // micro)


def learning_rate(step: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup then cosine decay to min_lr (nanoGPT's get_lr, exactly).

    Keyed to the optimizer step, which counts a fixed number of tokens (the global batch never
    changes with the world size), so the schedule is a function of tokens consumed.
    """
    import math

    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)
