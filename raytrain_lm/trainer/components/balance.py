"""`scaling.balance`: each rank's share of the global batch in proportion to its speed.

Every step ends in a collective (DDP's all-reduce, FSDP's reduce-scatter), so with equal shares
a group runs at its slowest rank's pace: an A100 beside an L4 waits most of each step. Shares in
proportion to speed let every rank finish its part at about the same time. The update stays the
same, because step.py weights each forward pass's loss by its part of the global batch.

- `none`: equal shares (the global batch divides by every allowed world size).
- `{TYPE: weight, ...}`: shares by each rank's accelerator type (`default` for types not named).
- `auto`: equal shares first; each rank times its own forward passes (a forward under DDP holds
  no collective, so it measures this device alone, where a step or a backward would include the
  wait for the others) over `MEASURE_STEPS` steps after the warm-up, then shares follow the
  measured sequences per second. The plan is checked again at every checkpoint and re-made when
  the slowest rank's forward time per step exceeds the group's mean by more than
  `scaling.balance_tolerance` (a node throttled, a neighbour's job). Every (re)start measures
  afresh: a restart may change the group.

Every rank computes the plan from the same all-reduced measurements, so all agree on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from raytrain_lm import devices
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.distributed.collectives import all_reduce

MEASURE_STEPS = 5  # steps timed after the warm-up before auto makes its first plan
MIN_SEQUENCES = 4  # per rank: fewer timed sequences are too few to re-plan on


class ForwardClock:
    """This rank's forward time and sequences since the last `take`, on the device's own
    clock (CUDA events, read only where the host waits for the device anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._started: float | torch.cuda.Event = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._seconds, self._sequences = 0.0, 0

    def start(self) -> None:
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self, sequences: int) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end, sequences))
        else:
            self._seconds += time.perf_counter() - self._started
            self._sequences += sequences

    def take(self) -> tuple[float, int]:
        """(seconds, sequences) timed since the last take; on CUDA, call it at a read."""
        for start, end, sequences in self._events:
            end.synchronize()  # done already at a read: no wait
            self._seconds += start.elapsed_time(end) / 1000.0
            self._sequences += sequences
        measured = (self._seconds, self._sequences)
        self._events, self._seconds, self._sequences = [], 0.0, 0
        return measured


def type_weights(setting: Mapping[str, float], types: Sequence[str]) -> list[float]:
    """Each rank's weight from `scaling.balance: {TYPE: weight}` by its accelerator type."""
    weights = [devices.by_accelerator_type(setting, t) for t in types]
    missing = sorted({t for t, w in zip(types, weights, strict=True) if w is None})
    if missing:
        raise UserError(
            f"scaling.balance gives no weight for accelerator type(s) {', '.join(missing)} in "
            f"this group; add them or a `default` weight (the group has {sorted(set(types))})"
        )
    return [float(w) for w in weights]


@dataclass(frozen=True)
class Speeds:
    """Each rank's measured forward seconds and sequences since the plan was made."""

    seconds: tuple[float, ...]
    sequences: tuple[int, ...]

    @classmethod
    def gather(cls, clock: ForwardClock, rank: int, world: int, device: torch.device) -> Speeds:
        """Every rank's measurement, on every rank (one all-reduce; a collective)."""
        seconds, sequences = clock.take()
        values = [0.0] * (2 * world)
        values[rank], values[world + rank] = seconds, float(sequences)
        reduced = all_reduce(values, device)
        return cls(tuple(reduced[:world]), tuple(int(round(n)) for n in reduced[world:]))

    @property
    def enough(self) -> bool:
        return min(self.sequences) >= MIN_SEQUENCES and min(self.seconds) > 0

    @property
    def per_second(self) -> list[float]:
        """Sequences per second of forward, per rank."""
        return [n / s for n, s in zip(self.sequences, self.seconds, strict=True)]

    def imbalance(self, shares: Sequence[int]) -> float:
        """How much longer the slowest rank's forwards take per step under `shares` than the
        ranks' mean (0: perfectly balanced)."""
        times = [share / speed for share, speed in zip(shares, self.per_second, strict=True)]
        return max(times) / (sum(times) / len(times)) - 1.0


def replan_weights(speeds: Speeds, shares: Sequence[int], tolerance: float) -> list[float] | None:
    """New weights (the measured speeds) when `shares` leave the slowest rank's forwards
    longer than the mean by more than `tolerance`; None to keep the plan, or when too little
    was measured to tell."""
    if not speeds.enough or speeds.imbalance(shares) <= tolerance:
        return None
    return speeds.per_second


def per_type_metrics(
    types: Sequence[str],
    shares: Sequence[int],
    tokens_per_s: float,
    flops_per_token: float,
    prices: Sequence[float],
    peaks: Sequence[float],
) -> dict[str, dict[str, float]]:
    """Per accelerator type: the tokens/s its ranks train (their shares of the group's), their
    MFU against the peaks of the devices they train on (`peaks`: per rank, from
    `devices.training_peaks`, as the progress line's MFU is), and, when each of its ranks
    has a price (`prices`: per rank, from `fault.price_per_hour` and the rank's node market;
    0 for none), what a million of its tokens cost."""
    figures: dict[str, dict[str, float]] = {}
    for kind in sorted(set(types)):
        ranks = [r for r, t in enumerate(types) if t == kind]
        kind_tokens_per_s = tokens_per_s * sum(shares[r] for r in ranks) / sum(shares)
        row = {
            "workers": float(len(ranks)),
            "tokens_per_s": kind_tokens_per_s,
            "mfu": devices.group_mfu(flops_per_token, kind_tokens_per_s, [peaks[r] for r in ranks]),
        }
        if all(prices[r] > 0 for r in ranks) and kind_tokens_per_s > 0:
            usd_per_hour = sum(prices[r] for r in ranks)
            row["usd_per_mtok"] = usd_per_hour / 3600.0 / kind_tokens_per_s * 1e6
        figures[kind] = row
    return figures
