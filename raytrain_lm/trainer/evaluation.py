"""Validation loss over the fixed validation set, identical whatever the world size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.stream import validation_batches
from raytrain_lm.trainer import hardware


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over the ranks (the values themselves on a single worker)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_reduce_min(value: float, device: torch.device) -> float:
    """The smallest of the ranks' values (the value itself on a single worker)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor.item()


@dataclass(frozen=True)
class Evaluator:
    data_dir: str
    manifest: Manifest
    seq_len: int
    sequences: int | None  # None: the whole validation split
    batch: int
    rank: int
    world: int
    device: torch.device
    bf16: bool
    # A sharded model's forward is a collective (it gathers weights): every rank must run as
    # many as the rank with the most batches, the extra ones counting for nothing.
    same_count_on_every_rank: bool = False

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        """Mean token loss; each rank takes a strided share, the sums are reduced."""
        model.eval()
        total, count = 0.0, 0
        shares = list(
            validation_batches(
                self.data_dir,
                self.manifest,
                self.seq_len,
                self.sequences,
                self.rank,
                self.world,
                self.batch,
            )
        )
        padding: list[np.ndarray] = []
        if self.same_count_on_every_rank:
            most = int(-all_reduce_min(-float(len(shares)), self.device))
            filler = shares[0] if shares else np.zeros((1, self.seq_len + 1), np.int64)
            padding = [filler] * (most - len(shares))
        for i, tokens in enumerate(shares + padding):
            t = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
            with hardware.autocast(self.device, self.bf16):
                _, loss = model(t[:, :-1], t[:, 1:])
            if i < len(shares):
                total += float(loss) * t.shape[0]
                count += t.shape[0]
        model.train()
        total, count = all_reduce_sum([total, float(count)], self.device)
        return total / max(count, 1.0)
