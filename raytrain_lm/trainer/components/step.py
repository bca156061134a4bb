"""One optimizer step of one worker: its share of the global batch forward and backward in
micro-batches, clip, update. Pure PyTorch: no Ray here.

Each micro-batch's mean loss is weighted by its part of the global batch (b sequences of G,
times the world size W that DDP and FSDP divide the summed gradients by), so the update is the
mean over the global batch's tokens however unevenly the ranks share it (trainer/components/balance.py).
With equal shares the weight is 1/accumulation, as usual.

Under DDP gradients are all-reduced once, on the last micro-batch. Under FSDP each micro-batch's
backward reduce-scatters: skipping it would keep whole unsharded gradients between micro-batches,
the very memory sharding is for; so under FSDP every rank makes the same number of passes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from raytrain_lm import devices
from raytrain_lm.trainer.components.balance import ForwardClock
from raytrain_lm.trainer.components.batch_plan import BatchPlan


@dataclass(frozen=True)
class StepParts:
    model: torch.nn.Module  # as wrapped for training (DDP, compiled; or sharded in place)
    raw_model: torch.nn.Module  # the model itself, for clipping and checkpoints
    optimizer: torch.optim.Optimizer
    plan: BatchPlan
    rank: int
    device: torch.device
    bf16: bool
    grad_clip: float  # 0: no clipping
    clock: ForwardClock | None = None  # times this rank's forward passes (scaling.balance)

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP wrapper, inside torch.compile's when compiled."""
        inner = getattr(self.model, "_orig_mod", self.model)
        return inner if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else None


@dataclass
class StepResult:
    loss: torch.Tensor  # this worker's part of the global mean loss (the ranks' sum is it)
    grad_norm: torch.Tensor
    positions: np.ndarray  # the global sequence positions this worker consumed
    data_wait_s: float  # time spent waiting for batches
    committed: bool = True  # False: the update was not applied (a replica group's vote)


def step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout noise is a function of (seed, step, rank), so a resumed run draws the same."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (1 << 62)


def train_step(
    parts: StepParts,
    batches: Iterator[tuple[np.ndarray, np.ndarray]],
    lr: float,
    commit: Callable[[], bool] | None = None,
) -> StepResult:
    """`batches` yields this rank's share of each step at once: (positions, tokens[share,
    seq_len + 1]). `commit` (replica groups) is asked, once the gradients are reduced,
    whether to apply the update."""
    waited = time.perf_counter()
    positions, tokens = next(batches)
    data_wait = time.perf_counter() - waited
    positions = positions.copy()  # a view would pin its Ray Data block
    loss = accumulate_gradients(parts, tokens)
    grad_norm, committed = apply_update(parts, lr, commit)
    return StepResult(loss, grad_norm, positions, data_wait, committed)


def accumulate_gradients(parts: StepParts, tokens: np.ndarray) -> torch.Tensor:
    """Forward and backward of this rank's share `tokens` in its passes; returns its part
    of the global mean loss (on the device, not read)."""
    plan = parts.plan
    sizes = plan.pass_sizes(parts.rank)
    loss_sum = torch.zeros((), device=parts.device)
    first = 0
    for i, size in enumerate(sizes):
        # A pass with no sequences of its own (FSDP, a share smaller than the passes) runs one
        # sequence at weight 0, so that its all-gathers and reduce-scatters meet the others'.
        rows = tokens[first : first + size] if size else tokens[:1]
        first += size
        weight = plan.world_size * size / plan.global_batch
        t = devices.tokens_to_device(rows, parts.device)
        sync = contextlib.nullcontext()
        last = i == len(sizes) - 1
        if parts.ddp is not None and not last:
            sync = parts.ddp.no_sync()  # all-reduce gradients once, on the last micro-batch
        if hasattr(parts.model, "set_requires_all_reduce"):
            # hsdp: each pass reduce-scatters inside the shard group (keeping memory sharded),
            # but the all-reduce across groups, between nodes, waits for the last pass
            parts.model.set_requires_all_reduce(last)
        with sync:
            if parts.clock is not None:
                parts.clock.start()
            with devices.autocast(parts.device, parts.bf16):
                _, loss = parts.model(t[:, :-1], t[:, 1:])  # (B, T) in, scalar loss out
            if parts.clock is not None:
                parts.clock.stop(size)
            (loss * weight).backward()
        loss_sum += loss.detach() * (size / plan.global_batch)
    return loss_sum


def apply_update(
    parts: StepParts, lr: float, commit: Callable[[], bool] | None = None
) -> tuple[torch.Tensor, bool]:
    """Clips the reduced gradients and steps the optimizer (unless `commit` says no);
    returns the gradient norm and whether the update was applied."""
    clip = parts.grad_clip if parts.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(parts.raw_model.parameters(), clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor (sharded gradients): over all shards
        grad_norm = grad_norm.full_tensor()
    committed = commit is None or commit()
    if committed:
        for group in parts.optimizer.param_groups:
            group["lr"] = lr
        parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return grad_norm, committed
