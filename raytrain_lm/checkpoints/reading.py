"""Reading a checkpoint back: a bucket's is downloaded to a local folder first; a checkpoint
that fails verification or loading is skipped for the one before it (`restore_newest`)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import load_file

from raytrain_lm.checkpoints.contents import (
    MARKER_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    TrainState,
    load_model_state,
)
from raytrain_lm.checkpoints.markers import damage, is_complete, read_file
from raytrain_lm.storage import Location, filesystem, is_uri

DOWNLOAD_CHUNK = 1 << 26  # 64 MiB per ranged GET (and per copying thread's buffer)


@contextlib.contextmanager
def local_copy(location: str | Path) -> Iterator[Path]:
    """A local folder holding the checkpoint at `location`: itself, or a download of it."""
    location = str(location)
    if not is_uri(location):
        yield Path(location)
        return
    fs, inner = filesystem(location)
    folder = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
    try:
        pafs.copy_files(
            inner,
            str(folder),
            source_filesystem=fs,
            destination_filesystem=pafs.LocalFileSystem(),
            # Each read of a bucket file is a ranged GET that pays a round trip: the default
            # 1 MiB made a 1.2 GB checkpoint 1,156 sequential requests.
            chunk_size=DOWNLOAD_CHUNK,
        )
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_state(location: str | Path) -> TrainState:
    return TrainState(**json.loads(read_file(str(location), STATE_FILE) or b""))


def _load_local(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> TrainState:
    load_model_state(model, load_file(str(directory / MODEL_FILE), device=str(device)))
    if optimizer is not None:
        saved = torch.load(directory / OPTIMIZER_FILE, map_location=device, weights_only=True)
        if set(saved) == {"inner", "outer"} and isinstance(optimizer, torch.optim.Optimizer):
            saved = saved["inner"]  # DiLoCo's (diloco.py), resumed with every-step sync
        optimizer.load_state_dict(saved)
    return read_state(directory)


def load_checkpoint(
    location: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> TrainState:
    if not is_complete(location):
        raise RuntimeError(f"checkpoint {location} is incomplete (no {MARKER_FILE} marker)")
    with local_copy(location) as directory:
        return _load_local(directory, model, optimizer, device)


def _by_step(folders: Iterable[str]) -> list[Location]:
    return sorted((Location(str(p)) for p in folders), key=lambda p: (read_state(p).step, p.name))


def restore_newest(
    candidates: Iterable[str | Path],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    load: Callable[[Path], TrainState] | None = None,
) -> tuple[Location, TrainState] | None:
    """Loads the newest of `candidates` that verifies and loads; says why it skipped any.
    `load` replaces loading into `model` and `optimizer` (a sharded checkpoint, which all
    ranks load together, is only verified here: `load=read_state`)."""
    complete = {str(p): p for p in candidates if is_complete(p)}
    for location in reversed(_by_step(complete)):
        try:
            with local_copy(location) as directory:
                problem = damage(directory)
                if problem is None:
                    if load is not None:
                        return location, load(directory)
                    return location, _load_local(directory, model, optimizer, device)
        except Exception as exc:  # damaged in a way the checksum could not see, or unreadable
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(
            f"[raytrain-lm] cannot restore {location.name} ({problem}); trying the one before it",
            file=sys.__stdout__,
            flush=True,
        )
    return None
