"""Values that replica groups sum in one reduction, by name: a typed packer.

Each kind of reduction (a step's, a DiLoCo sync's) is a dataclass whose fields are numbers
or lists of numbers; `Packer` lays them out flat in field order for the all-reduce and reads
the summed values back into the same dataclass, so that nobody indexes into the sums. A
field may hold a device tensor (a loss not read yet): packing keeps it on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Packer(Generic[T]):
    """Lays out `kind`'s fields flat: numbers take one slot, lists the length given here."""

    def __init__(self, kind: type[T], **lengths: int):
        self.kind = kind
        self.fields = [f.name for f in dataclasses.fields(kind)]
        unknown = set(lengths) - set(self.fields)
        assert not unknown, f"{kind.__name__} has no fields {unknown}"
        self.lengths = {name: lengths.get(name, 0) for name in self.fields}  # 0: a number

    def pack(self, values: T, device: torch.device) -> torch.Tensor:
        parts = []
        for name in self.fields:
            value, length = getattr(values, name), self.lengths[name]
            if isinstance(value, torch.Tensor):
                flat = value.detach().to(device, torch.float64).reshape(-1)
                assert flat.numel() == max(1, length), f"{name}: {flat.numel()} values"
                parts.append(flat)
                continue
            items = [float(value)] if length == 0 else [float(v) for v in value]
            assert len(items) == max(1, length), f"{name}: {len(items)} values, not {length}"
            parts.append(torch.tensor(items, dtype=torch.float64, device=device))
        return torch.cat(parts)

    def unpack(self, summed: Sequence[float] | torch.Tensor) -> T:
        flat = summed.tolist() if isinstance(summed, torch.Tensor) else list(summed)
        found: dict[str, Any] = {}
        at = 0
        for name in self.fields:
            length = self.lengths[name]
            found[name] = flat[at] if length == 0 else flat[at : at + length]
            at += max(1, length)
        assert at == len(flat), f"{len(flat)} values for {at} slots"
        return self.kind(**found)

    @property
    def size(self) -> int:
        return sum(max(1, n) for n in self.lengths.values())
