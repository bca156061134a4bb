"""How a configured global batch maps onto the current world size (recomputed at every start),
where an invocation stops, and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain_lm.config import TrainingConfig


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch: int  # sequences per optimizer step, all workers together
    micro_batch: int  # sequences per worker per forward pass
    accumulation: int  # forward passes per worker per step

    @classmethod
    def derive(cls, cfg: TrainingConfig, world_size: int) -> BatchPlan:
        g = cfg.global_batch_size
        per_rank, left = divmod(g, world_size)
        micro = cfg.micro_batch_size or per_rank
        # RunConfig refuses a global batch that some allowed world size cannot split evenly
        # (config.py), so every world size Ray Train may pick divides it here.
        assert left == 0 and per_rank % micro == 0, (g, world_size, micro)
        return cls(world_size, g, micro, per_rank // micro)


def end_step(cfg: TrainingConfig) -> int:
    """The step this invocation trains to: max_steps, or stop_after_step if that is sooner."""
    return min(cfg.max_steps, cfg.stop_after_step or cfg.max_steps)


def learning_rate(step: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup then cosine decay to min_lr (nanoGPT's get_lr, exactly).

    Keyed to the optimizer step, which counts a fixed number of tokens (the global batch never
    changes with the world size), so the schedule is a function of tokens consumed.
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)
