"""One optimizer step of one worker: micro-batches forward and backward, clip, update. Pure
PyTorch: no Ray here.

Under DDP gradients are all-reduced once, on the last micro-batch. Under FSDP each micro-batch's
backward reduce-scatters: skipping it would keep whole unsharded gradients between micro-batches,
the very memory sharding is for."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from raytrain_lm.trainer import hardware
from raytrain_lm.trainer.plan import BatchPlan


@dataclass(frozen=True)
class StepParts:
    model: torch.nn.Module  # as wrapped for training (DDP, compiled; or sharded in place)
    raw_model: torch.nn.Module  # the model itself, for clipping and checkpoints
    optimizer: torch.optim.Optimizer
    plan: BatchPlan
    device: torch.device
    bf16: bool
    grad_clip: float  # 0: no clipping

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP wrapper, inside torch.compile's when compiled."""
        inner = getattr(self.model, "_orig_mod", self.model)
        return inner if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else None


@dataclass
class StepResult:
    loss: torch.Tensor  # this worker's mean loss over its micro-batches, on the device
    grad_norm: torch.Tensor
    positions: list[np.ndarray]  # the global sequence positions consumed, per micro-batch
    data_wait_s: float  # time spent waiting for batches


def step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout noise is a function of (seed, step, rank), so a resumed run draws the same."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (1 << 62)


def train_step(
    parts: StepParts, batches: Iterator[tuple[np.ndarray, np.ndarray]], lr: float
) -> StepResult:
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    accumulation = parts.plan.accumulation
    loss_sum = torch.zeros((), device=parts.device)
    positions, data_wait = [], 0.0
    for micro in range(accumulation):
        waited = time.perf_counter()
        micro_positions, tokens = next(batches)
        data_wait += time.perf_counter() - waited
        positions.append(micro_positions.copy())  # a view would pin its Ray Data block
        t = hardware.tokens_to_device(tokens, parts.device)
        sync = contextlib.nullcontext()
        if parts.ddp is not None and micro < accumulation - 1:
            sync = parts.ddp.no_sync()  # all-reduce gradients once, on the last micro-batch
        with sync:
            with hardware.autocast(parts.device, parts.bf16):
                _, loss = parts.model(t[:, :-1], t[:, 1:])  # (B, T) in, scalar loss out
            (loss / accumulation).backward()
        loss_sum += loss.detach()
    clip = parts.grad_clip if parts.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(parts.raw_model.parameters(), clip)
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over all shards
        grad_norm = grad_norm.full_tensor()
    parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum / accumulation, grad_norm, positions, data_wait)
