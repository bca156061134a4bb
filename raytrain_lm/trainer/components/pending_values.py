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

from raytrain_lm.trainer.distributed.collectives import reduce_on_device

WARMUP_STEPS = 3  # the first steps of a group pay for start-up: not counted in tokens/s


@dataclass
class Interval:
    """What a read returns: each pending step's metrics, and the interval's totals."""

    steps: list[tuple[int, dict[str, float]]]  # (step, its metrics), oldest first
    seconds: float  # wall time from the interval's start to the read
    data_wait_s: float  # of which the host waited for batches


@dataclass
class PendingSteps:
    world: int
    loss_copies: int = 1  # ranks that compute the same part (a tensor-parallel group)
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

    def snapshot(self) -> list[tuple[int, float, float, dict[str, float]]]:
        """The queued steps, values read (step, loss, grad norm, host metrics), for a replica
        group that heals from this one and may log them in its place."""
        losses = [float(t) for t in self._losses]
        norms = [float(t) for t in self._norms]
        return [
            (step, loss, norm, dict(host))
            for (step, host), loss, norm in zip(self._host, losses, norms, strict=True)
        ]

    def adopt(self, steps: list[tuple[int, float, float, dict[str, float]]], device) -> None:
        """Queues the steps of a `snapshot` in place of whatever was queued."""
        self._losses = [torch.tensor(loss, device=device) for _, loss, _, _ in steps]
        self._norms = [torch.tensor(norm, device=device) for _, _, norm, _ in steps]
        self._host = [(step, host) for step, _, _, host in steps]

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
        values[:n] /= self.loss_copies
        read = values.tolist()  # the wait
        steps = [
            (step, {"train/loss": read[i], "train/grad_norm": read[n + i], **host})
            for i, (step, host) in enumerate(self._host)
        ]
        interval = Interval(steps, self.elapsed(), self._data_wait_s)
        self._losses, self._norms, self._host, self._data_wait_s = [], [], [], 0.0
        self.restart_clock()
        return interval


class Throughput:
    """Tokens per second over this group's steps, leaving out the first few (start-up)."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.step_seconds = 0.0  # every step of this group, for goodput
        self._steady_from = first_step
        self._tokens, self._seconds = 0, 0.0
        self._last = float("nan")

    def add(self, step: int, seconds: float, tokens: int, steps: int = 1) -> None:
        """An interval of `steps` steps ending at `step`."""
        self.step_seconds += seconds
        self._last = tokens / seconds
        if step - steps >= self._steady_from + WARMUP_STEPS:
            self._tokens += tokens
            self._seconds += seconds

    def restart_steady(self, step: int) -> None:
        """From `step` on the group runs at another pace (a new batch plan): count that one."""
        self._steady_from = step
        self._tokens, self._seconds = 0, 0.0

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds else self._last
