"""What a checkpoint folder holds: its files' names, the train state, and the weights as
safetensors stores them (each tied weight once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raytrain_lm.errors import UserError
from raytrain_lm.rundir import CONFIG_FILE as CONFIG_FILE  # callers still import it from here

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
MARKER_FILE = "COMPLETE"
# Written into a checkpoint registered as a model version: pruning leaves it, as the registry
# points at its bytes (there is no second copy).
KEEP_FILE = "KEEP"
PART_PREFIX = "PART-"  # one rank's listing of the files it wrote into a sharded checkpoint


def same_format(strategy: str, other: str) -> bool:
    """Whether a checkpoint written under one strategy loads under the other: whole weights
    (ddp) only under ddp; DCP shards under any sharded layout (fsdp, hsdp, any mesh)."""
    return (strategy == "ddp") == (other == "ddp")


def check_strategy_resumes(run: str, setting: str, checkpointed: str) -> None:
    """Refuses, before any worker starts, a resume whose strategy cannot read the checkpoints."""
    if setting != "auto" and not same_format(setting, checkpointed):
        raise UserError(
            f"run '{run}' was checkpointed with parallel.strategy={checkpointed}, now "
            f"{setting}; resume with {checkpointed}, a strategy that writes the same "
            "checkpoints (fsdp and hsdp share theirs), auto, or choose another name=..."
        )


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # training tokens consumed
    position: int = 0  # next unconsumed sequence in the global order (see data/order.py)
    world_size: int = 0  # at the time of saving, for the log only: resume works at any size
    strategy: str = "ddp"  # ddp: whole weights and optimizer state; fsdp, hsdp: DCP shards
    val_loss: float | None = None
    val_step: int | None = None  # the step val_loss was measured at
    train_loss: float | None = None  # at this step, all ranks: the figures of the run so far
    tokens_per_s: float | None = None
    shares: list[int] = field(default_factory=list)  # each rank's sequences per step, for the log
    per_type: dict[str, dict[str, float]] = field(default_factory=dict)  # by accelerator type


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each name of a tied weight beyond its first (an output projection tied to the token
    embedding) -> that first name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights, each tied weight once (safetensors refuses shared storage)."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for alias in tied_aliases(model):
        del state[alias]
    return state


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    state = dict(state)
    for alias, name in tied_aliases(model).items():
        state[alias] = state[name]
    model.load_state_dict(state)
