"""The loop's few collectives, none of which makes the host wait for the device per step.

- `all_reduce`: host values, reduced at the steps that read them anyway (logging, evaluation,
  checkpoints).
- `reduce_on_device`: a device tensor summed in place; whoever reads it later waits then.
- `FlagChannel`: rank 0's signal flags, carried to every rank every step over a CPU (gloo)
  group, so that every rank acts on them at the same step without touching the device.
- `from_chief`: what rank 0 alone works out (which checkpoint to restore), on every rank,
  however long rank 0 takes.

Gloo groups that span nodes must bind to the network the nodes share: `pin_gloo_interface`.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"

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


def from_chief(work: Callable[[], T], timeout_s: float) -> T:
    """`work()` run by rank 0 alone; its result, or the exception it raised, on every rank.

    The others wait in a CPU (gloo) group of its own whose timeout is `timeout_s`: rank 0 may
    take many minutes (downloading and hashing a checkpoint of many GB), and waiting in the
    default group would run into its collective timeout, where NCCL's watchdog aborts the
    process. Every rank calls this at the same point (the group's creation is a collective).
    """
    if not _distributed():
        return work()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        box: list = [None]
        failure: BaseException | None = None
        if dist.get_rank() == 0:
            try:
                box[0] = (True, work())
            except Exception as exc:
                failure = exc
                box[0] = (False, _picklable(exc))
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    succeeded, value = box[0]
    if not succeeded:
        raise value
    return value


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"rank 0 failed: {type(exc).__name__}: {exc}")


def gloo_interface_for(address: str) -> str | None:
    """The network interface that holds `address` (an IPv4 or IPv6 address), or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def pin_gloo_interface(node_address: str) -> str | None:
    """Makes gloo groups created from now on in this process bind to the interface holding
    `node_address` (the address the cluster knows this node by), unless the user chose one
    (GLOO_SOCKET_IFNAME). By default gloo binds to what the hostname resolves to, often
    127.0.1.1 on Ubuntu images: a group across nodes then never connects. Returns the
    interface in use (None: gloo's default)."""
    if not os.environ.get(GLOO_INTERFACE_ENV):
        interface = gloo_interface_for(node_address)
        if interface is not None:
            os.environ[GLOO_INTERFACE_ENV] = interface
    return os.environ.get(GLOO_INTERFACE_ENV) or None


class FlagChannel:
    """Carries small integer flags from every rank to every rank (summed) each step.

    On GPUs the process group is NCCL, whose collectives run on the device: a flag read
    from one would wait for every kernel queued before it. A gloo group over CPU tensors
    costs one host round trip instead, and the device's queue keeps running.
    """

    def __init__(self, device: torch.device, timeout_s: float):
        self.group = None
        if _distributed() and device.type != "cpu":
            # A collective: every rank creates it. Across nodes it binds to the interface
            # pin_gloo_interface chose (the worker does that first).
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def share(self, flags: list[int]) -> list[int]:
        if not _distributed():
            return flags
        tensor = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.numpy().tolist()  # a host tensor: no device to wait for
