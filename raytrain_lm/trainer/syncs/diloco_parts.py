"""The parts DiLoCo's outer update (diloco.py) is built from: the Manager as DiLoCo's fragments
see it (counting bytes), what a checkpoint holds of the optimizers, and for Streaming DiLoCo
(`diloco.fragments` > 1, Douillard et al., arXiv 2501.18512) the model's fragments, where in a
commit unit each fragment syncs, and the weights of the unit's start that a failed unit goes
back to.

Streaming DiLoCo syncs one fragment of the model at a time, in turn, so that the link carries
a fragment's pseudo-gradient every H/F steps instead of the whole model's every H: the peak
bandwidth falls by F. Its fragments sync at different steps, so the run's state never has a
point where every fragment holds the same positions, and a group lost between two of those
syncs would leave positions counted for some fragments and not for others. The commit unit
gives that point back: K = `diloco.full_sync_every` rounds, in which each fragment syncs in
turn on its own schedule and, at the unit's end, every fragment syncs at once. Each fragment
still syncs K times a unit (the same bytes per token as plain DiLoCo); the unit's positions
count when its last sync commits; a failure anywhere in it puts the unit's start back.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

from raytrain_lm.errors import UserError
from raytrain_lm.trainer.groups.quorum import ByteCounter

UNIT_START_KEY = "raytrain_lm_unit_start"  # the Manager's name for UnitStart's state


class CountingManager:
    """torchft's Manager as DiLoCo's fragment sees it: every call passes through; the bytes
    each all-reduce hands to the network are counted."""

    def __init__(self, manager, counter: ByteCounter):
        self._manager, self._counter = manager, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, **kwargs):
        self._counter.add(tensor, 1 if should_quantize else None)  # quantized: fp8 elements
        return self._manager.allreduce(tensor, should_quantize=should_quantize, **kwargs)


class InnerAndOuter:
    """What a DiLoCo checkpoint holds of its optimizers: the inner AdamW's and the outer SGDs'
    state, one per fragment (at a unit's end the weights are the outer ones: nothing else to
    keep)."""

    def __init__(self, inner: torch.optim.Optimizer, outers: list[torch.optim.Optimizer]):
        self.inner, self.outers = inner, outers

    def state_dict(self) -> dict[str, Any]:
        outer = [o.state_dict() for o in self.outers]
        return {"inner": self.inner.state_dict(), "outer": outer[0] if len(outer) == 1 else outer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"inner", "outer"}:  # every-step sync's: the outer momentum from zero
            self.inner.load_state_dict(state)
            return
        self.inner.load_state_dict(state["inner"])
        outer = [state["outer"]] if isinstance(state["outer"], dict) else state["outer"]
        if len(outer) == len(self.outers):  # else another fragment count: momentum from zero
            for optimizer, saved in zip(self.outers, outer, strict=True):
                optimizer.load_state_dict(saved)


class ModelFragment(nn.Module):
    """A contiguous run of a model's parameters, as one of torchft's DiLoCo fragments: the
    same Parameter objects (no copy), under names without dots."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__()
        for name, param in named:
            self.register_parameter(name.replace(".", ":"), param)


def model_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """The model as `count` fragments: contiguous runs of its parameters in their order (the
    layers'), of about equal size. One fragment: the model itself."""
    if count == 1:
        return [model]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if len(named) < count:
        raise UserError(
            f"diloco.fragments={count} is more than the model's {len(named)} parameter tensors"
        )
    reached = list(itertools.accumulate(p.numel() for _, p in named))  # size of named[: i + 1]
    ends, end = [], 0
    for k in range(1, count):
        # The first cut at or past k/count of the size, leaving a tensor for each later one.
        end += 1
        while end < len(named) - (count - k) and reached[end - 1] < reached[-1] * k / count:
            end += 1
        ends.append(end)
    starts = [0, *ends]
    fragments = [named[a:b] for a, b in zip(starts, [*ends, len(named)], strict=True)]
    return [ModelFragment(f) for f in fragments]


def unit_schedule(length: int, sync_every: int, fragments: int) -> dict[int, list[int]]:
    """Where a commit unit of `length` steps syncs single fragments: {inner steps taken: the
    fragments that sync then}. Fragment j syncs H/F·(j+1) steps into the unit and every H after,
    while at least H steps of the unit are left after it; at the unit's end every fragment
    syncs (not listed). So each fragment syncs once per H steps on average, the whole unit
    long, and the unit's end is a sync of the whole model."""
    points: dict[int, list[int]] = {}
    stride = sync_every // fragments
    for fragment in range(fragments):
        step = stride * (fragment + 1)
        while step + sync_every <= length:
            points.setdefault(step, []).append(fragment)
            step += sync_every
    return dict(sorted(points.items()))


class UnitStart:
    """The weights and the outer optimizers' state at the last full sync (every fragment
    synced at once): what a unit that does not commit goes back to. A group that heals from a
    peer receives it too (registered with the Manager), so that it goes back with the others."""

    def __init__(self, model: nn.Module, outers: list[torch.optim.Optimizer], fragments, manager):
        self.model, self.outers, self.fragments = model, outers, fragments
        self.weights: dict[str, torch.Tensor] = {}
        self.outer_states: list[dict[str, Any]] = []
        manager.register_state_dict_fn(UNIT_START_KEY, self._load, self._save)

    def take(self) -> None:
        with torch.no_grad():
            self.weights = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.outer_states = [copy.deepcopy(o.state_dict()) for o in self.outers]

    def put_back(self) -> None:
        """The unit's start again: weights, outer optimizers, and each fragment's saved
        weights (from which its next pseudo-gradient is measured)."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.weights[name])
        for optimizer, state in zip(self.outers, self.outer_states, strict=True):
            optimizer.load_state_dict(copy.deepcopy(state))
        for fragment in self.fragments:
            fragment.save_parameters()

    def _save(self) -> dict[str, Any]:
        return {"weights": self.weights, "outer": self.outer_states}

    def _load(self, state: dict[str, Any]) -> None:
        self.weights = {name: tensor.clone() for name, tensor in state["weights"].items()}
        self.outer_states = copy.deepcopy(state["outer"])
