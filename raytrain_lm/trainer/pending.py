"""Per-step values kept on the device until a step that reads them.

Reading a device value (`float(loss)`) makes the host wait for every kernel queued before it;
done at every step, it leaves the GPU idle while the host prepares the next step. The loop
queues each step's loss and gradient norm here and reads them all at once, with one
all-reduce, at the steps that need them anyway (logging, evaluation, checkpoints, a stop or
spot notice), as torchtitan and nanoGPT do; every step still gets its own values in MLflow.
Wall time is measured per interval between reads: at a read the host has caught up with the
device, so an interval's time is the device's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from raytrain_lm.trainer.collectives import reduce_on_device


@dataclass
class Interval:
    """What a read returns: each pending step's metrics, and the interval's totals."""

    steps: list[tuple[int, dict[str, float]]]  # (step, its metrics), oldest first
    seconds: float  # wall time from the interval's start to the read
    data_wait_s: float  # of which the host waited for batches


@dataclass
class PendingSteps:
    world: int
    _losses: list[torch.Tensor] = field(default_factory=list)
    _norms: list[torch.Tensor] = field(default_factory=list)
    _host: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _data_wait_s: float = 0.0
    _started: float = field(default_factory=time.perf_counter)

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        host_metrics: dict[str, float],
        data_wait_s: float,
    ) -> None:
        """Queues one step: this rank's part of its loss (the ranks' parts sum to the step's
        loss) and its grad norm, device scalars not read, and the
        metrics the host knows already (learning rate, tokens)."""
        self._losses.append(loss.detach())
        self._norms.append(grad_norm.detach())
        self._host.append((step, host_metrics))
        self._data_wait_s += data_wait_s

    def __len__(self) -> int:
        return len(self._host)

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def restart_clock(self) -> None:
        """Time from here on is step time again (after an evaluation or a checkpoint)."""
        self._started = time.perf_counter()

    def read(self) -> Interval:
        """Every pending step's loss (summed over the ranks' parts) and grad norm, read with one
        all-reduce and one wait for the device; empties the queue and starts a new interval.
        Every rank calls it at the same step."""
        n = len(self._host)
        values = torch.stack([*self._losses, *self._norms]).to(torch.float64)
        reduce_on_device(values)
        values[n:] /= self.world  # the norm is the same on every rank
        read = values.tolist()  # the wait
        steps = [
            (step, {"train/loss": read[i], "train/grad_norm": read[n + i], **host})
            for i, (step, host) in enumerate(self._host)
        ]
        interval = Interval(steps, self.elapsed(), self._data_wait_s)
        self._losses, self._norms, self._host, self._data_wait_s = [], [], [], 0.0
        self.restart_clock()
        return interval
