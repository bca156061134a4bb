"""What replica groups tell each other in every step's summed values (trainer/groups/replicas.py):
a checksum of the positions each took (exactly once, whoever took part), and who took part:
each participant's accelerator type and hourly price, in its own slots of the sum, so that
whichever group is chief knows the step's types and prices (per-type metrics) and the price of
the groups training (cost) without a further collective."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_LOW_BITS = 1023  # positions' low bits: their squares sum exactly in float64
_BYTES_PER_SLOT = 6  # 48 bits: an integer float64 holds them exactly
_TYPE_SLOTS = 5  # accelerator types up to 30 characters ("AMD-Instinct-MI300X-OAM": 23)
SLOTS_PER_PARTICIPANT = _TYPE_SLOTS + 1  # its type, then its price per hour


def position_checksum(taken: np.ndarray) -> list[float]:
    """What a participant reports of the positions it took: their count, their sum and the sum
    of their low bits' squares (exact in float64 for any run's positions), summed over the
    participants with the loss."""
    return [float(len(taken)), float(taken.sum()), float(((taken & _LOW_BITS) ** 2).sum())]


def check_step_taken(step: int, global_batch: int, checksum: list[float]) -> None:
    """The participants of committed step `step + 1` took its positions, each exactly once."""
    g = global_batch
    wanted = position_checksum(np.arange(step * g, (step + 1) * g, dtype=np.int64))
    if checksum != wanted:
        raise RuntimeError(
            f"step {step + 1}: the participants took positions {checksum} (count, sum, "
            f"squares), not the step's {wanted}"
        )


def roster_slots(participant: int, participants: int, kind: str, price: float) -> list[float]:
    """This participant's type and price in its slots, zeros in everyone else's."""
    raw = kind.encode("ascii", "replace")[: _BYTES_PER_SLOT * _TYPE_SLOTS]
    raw = raw.ljust(_BYTES_PER_SLOT * _TYPE_SLOTS, b"\0")
    mine = [
        float(int.from_bytes(raw[i : i + _BYTES_PER_SLOT], "big"))
        for i in range(0, len(raw), _BYTES_PER_SLOT)
    ]
    slots = [0.0] * (SLOTS_PER_PARTICIPANT * participants)
    start = SLOTS_PER_PARTICIPANT * participant
    slots[start : start + SLOTS_PER_PARTICIPANT] = [*mine, float(price)]
    return slots


def read_roster(summed: Sequence[float]) -> tuple[list[str], list[float]]:
    """Every participant's type and hourly price, in participating rank order."""
    types, prices = [], []
    for start in range(0, len(summed), SLOTS_PER_PARTICIPANT):
        *codes, each_price = summed[start : start + SLOTS_PER_PARTICIPANT]
        raw = b"".join(int(c).to_bytes(_BYTES_PER_SLOT, "big") for c in codes)
        types.append(raw.rstrip(b"\0").decode("ascii", "replace"))
        prices.append(each_price)
    return types, prices
