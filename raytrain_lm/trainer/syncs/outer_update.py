"""How the weights of replica groups come together at the end of a unit (rounds.py): the
outer update. `OuterUpdate` is what the rounds ask of one; DiLoCo's (syncs/diloco.py) and
LocalSGD's (syncs/local_sgd.py) are the two there are."""

from __future__ import annotations

from typing import Any, Protocol

from torch import optim


class OuterUpdate(Protocol):
    fragments: int  # the model's parts that sync in turn inside a unit (1: all at once)
    weight_syncs: float  # the whole model's worth of weights exchanged so far

    def on_manager(self, manager: Any, bytes_sent: Any) -> None:
        """Made on the group's torchft Manager before its first quorum: what a group that
        joins heals from is registered with it; `bytes_sent` counts what it hands the
        network."""

    def checkpointed_optimizer(self, inner: optim.Optimizer) -> Any:
        """What a checkpoint holds of the optimizers (a `state_dict` / `load_state_dict`)."""

    def unit_committed(self) -> None:
        """This point is a sync of the whole model: what a unit that fails goes back to."""

    def contribute_nothing(self) -> None:
        """This group heals mid-unit (its weights are a peer's): it sends nothing at the sync."""

    def sync_all(self, scale: float) -> bool:
        """The whole model's exchange over the quorum, scaled by `scale` (participants over
        the groups that trained), and whether it committed."""

    def sync_fragments(self, ids: list[int]) -> bool:
        """Single fragments' exchange inside a unit (Streaming DiLoCo)."""

    def roll_back(self) -> None:
        """The weights (and outer state) of the last sync of the whole model."""

    def forget_last_verdict(self) -> None:
        """Before a unit whose fragment syncs reuse the quorum of the sync before it."""
