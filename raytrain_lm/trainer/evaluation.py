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

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        """Mean token loss; each rank takes a strided share, the sums are reduced."""
        model.eval()
        total, count = 0.0, 0
        shares = validation_batches(
            self.data_dir,
            self.manifest,
            self.seq_len,
            self.sequences,
            self.rank,
            self.world,
            self.batch,
        )
        for tokens in shares:
            t = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
            with hardware.autocast(self.device, self.bf16):
                _, loss = model(t[:, :-1], t[:, 1:])
            total += float(loss) * t.shape[0]
            count += t.shape[0]
        model.train()
        total, count = all_reduce_sum([total, float(count)], self.device)
        return total / max(count, 1.0)
