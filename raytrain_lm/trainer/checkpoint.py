"""Checkpoint contents and atomicity. A checkpoint directory is complete only once its
COMPLETE marker exists, and the marker is written last; an incomplete one is never loaded."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
RNG_FILE = "rng.pt"
CONFIG_FILE = "config.yaml"
MARKER_FILE = "COMPLETE"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # training tokens consumed
    position: int = 0  # next unconsumed sequence in the global order (see data/order.py)
    world_size: int = 0  # at the time of saving, for the log only: resume works at any size
    val_loss: float | None = None


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights without the tied duplicate (safetensors refuses shared storage)."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to transformer.wte.weight
    return state


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    state = dict(state)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    tokenizer_json: str,
    config_yaml: str,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model_state(model), str(directory / MODEL_FILE))
    torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    torch.save({"torch": torch.get_rng_state()}, directory / RNG_FILE)
    (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
    (directory / MARKER_FILE).write_text("ok\n")


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER_FILE).is_file()


def read_state(directory: str | Path) -> TrainState:
    return TrainState(**json.loads((Path(directory) / STATE_FILE).read_text()))


def load_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> TrainState:
    directory = Path(directory)
    if not is_complete(directory):
        raise RuntimeError(f"checkpoint {directory} is incomplete (no {MARKER_FILE} marker)")
    load_model_state(model, load_file(str(directory / MODEL_FILE), device=str(device)))
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(directory / OPTIMIZER_FILE, map_location=device, weights_only=True)
        )
    return read_state(directory)


def latest_complete_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete `checkpoint_*` folder Ray Train left in a run directory."""
    found = [p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir() and is_complete(p)]
    if not found:
        return None
    return max(found, key=lambda p: read_state(p).step)


def copy_weights(checkpoint: Path, destination: Path) -> Path:
    destination.mkdir(parents=True, exist_ok=True)
    target = destination / MODEL_FILE
    shutil.copyfile(checkpoint / MODEL_FILE, target)
    return target
