"""The loop's few collectives, none of which makes the host wait for the device per step.

- `all_reduce`: host values, reduced at the steps that read them anyway (logging, evaluation,
  checkpoints).
- `reduce_on_device`: a device tensor summed in place; whoever reads it later waits then.
- `FlagChannel`: rank 0's signal flags, carried to every rank every step over a CPU (gloo)
  group, so that every rank acts on them at the same step without touching the device.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(
    values: list[float], device: torch.device, op: Literal["sum", "min", "max"] = "sum"
) -> list[float]:
    """Element-wise reduction over the ranks (the values themselves on a single worker)."""
    if not _distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _OPS[op]))
    return tensor.tolist()


def reduce_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the ranks, in place; queued on the device, nothing read."""
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class FlagChannel:
    """Carries small integer flags from every rank to every rank (summed) each step.

    On GPUs the process group is NCCL, whose collectives run on the device: a flag read
    from one would wait for every kernel queued before it. A gloo group over CPU tensors
    costs one host round trip instead, and the device's queue keeps running.
    """

    def __init__(self, device: torch.device, timeout_s: float):
        self.group = None
        if _distributed() and device.type != "cpu":
            # A collective: every rank creates it. Across nodes gloo finds its interface from
            # the hostname; where that resolves to a loopback address, set GLOO_SOCKET_IFNAME.
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def share(self, flags: list[int]) -> list[int]:
        if not _distributed():
            return flags
        tensor = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.numpy().tolist()  # a host tensor: no device to wait for
