"""Checkpoint contents and atomicity. A checkpoint directory is complete only once its
COMPLETE marker exists and every file the marker lists is there at its recorded size. The
marker is written last, and listing the files also covers copies that do not keep the write
order (Ray uploads a checkpoint's files in no particular order). An incomplete checkpoint is
never loaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
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
    val_step: int | None = None  # the step val_loss was measured at


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
    partially_written: Callable[[], None] | None = None,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model_state(model), str(directory / MODEL_FILE))
    if partially_written is not None:
        partially_written()  # a chaos test's moment to kill the writer
    torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    torch.save({"torch": torch.get_rng_state()}, directory / RNG_FILE)
    (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
    sizes = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    (directory / MARKER_FILE).write_text(json.dumps({"files": sizes}, indent=1))


def is_complete(directory: str | Path) -> bool:
    marker = Path(directory) / MARKER_FILE
    try:
        sizes = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, size in sizes.items():
        path = Path(directory) / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


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


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete `checkpoint_*` folders Ray Train left in a run directory, oldest step first."""
    found = [p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: (read_state(p).step, p.name))


def latest_complete_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the lowest val loss measured at its own step."""
    scored = []
    for path in complete_checkpoints(run_dir):
        state = read_state(path)
        if state.val_loss is not None and state.val_step == state.step:
            scored.append((state.val_loss, state.step, path))
    return min(scored)[2] if scored else None


def prune_checkpoints(run_dir: str | Path, keep_last: int, keep_best: bool) -> list[Path]:
    """Deletes complete checkpoints beyond the newest `keep_last` (and the best by val loss).

    Incomplete folders are left alone: one may be an upload still in progress.
    """
    found = complete_checkpoints(run_dir)
    keep = set(found[-keep_last:])
    best = best_checkpoint(run_dir) if keep_best else None
    if best is not None:
        keep.add(best)
    removed = [p for p in found if p not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def copy_weights(checkpoint: Path, destination: Path) -> Path:
    destination.mkdir(parents=True, exist_ok=True)
    target = destination / MODEL_FILE
    shutil.copyfile(checkpoint / MODEL_FILE, target)
    return target
