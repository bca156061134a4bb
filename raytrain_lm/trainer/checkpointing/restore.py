"""Which checkpoint a worker group resumes from, agreed on by all of its ranks.

Rank 0 chooses: the newest candidate that is complete, verifies (every file hashed against its
marker) and loads; it says why it skipped any. Under DDP it loads that one as it verifies it,
and the other ranks load the same one afterwards. A sharded checkpoint is loaded by all ranks
together (each reads what its shards need), so rank 0 only verifies it. Choosing can take
minutes for a large checkpoint in a bucket; the other ranks wait for the choice in a group of
its own with `checkpoint.restore_wait_s` (collectives.from_chief), not in the training group,
whose collective timeout would abort them. Pure PyTorch and files: no Ray here.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from raytrain_lm.checkpoints import (
    TrainState,
    load_checkpoint,
    read_state,
    restore_newest,
    same_format,
)
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.distributed.collectives import from_chief


def restore_group(
    candidates: Iterable[str | Path],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    rank: int,
    strategy: str,
    wait_s: float,
) -> tuple[str | None, TrainState]:
    """Every rank calls this at the same point: the checkpoint the group restored (None: none
    could be) and its train state, loaded into `model` and `optimizer` on every rank."""
    sharded = strategy != "ddp"
    candidates = list(candidates)

    def choose() -> tuple[str | None, TrainState]:
        found = restore_newest(
            candidates, model, optimizer, device, load=read_state if sharded else None
        )
        if found is None:
            return None, TrainState()
        location, state = found
        if not same_format(state.strategy, strategy):
            raise UserError(
                f"checkpoint {location} was written with parallel.strategy={state.strategy}; "
                f"this run uses {strategy}"
            )
        return str(location), state

    location, state = from_chief(choose, wait_s)
    if location is None:
        return None, state
    if sharded:
        from raytrain_lm.checkpoints.sharded import load_sharded_checkpoint

        state = load_sharded_checkpoint(location, model, optimizer)
    elif rank != 0:
        state = load_checkpoint(location, model, optimizer, device)
    return location, state
