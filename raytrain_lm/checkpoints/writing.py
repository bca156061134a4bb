"""Writing a checkpoint: to a local folder first, then uploaded into the run directory (a local
folder or a bucket) by `upload_checkpoint`, which retries while the bucket is away and writes
the markers last."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import save_file

from raytrain_lm.checkpoints.contents import (
    MARKER_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    TrainState,
    model_state,
)
from raytrain_lm.checkpoints.markers import file_listing, is_marker, part_marker, read_file
from raytrain_lm.storage import filesystem, is_uri, retrying

PART_WAIT_POLL_S = 0.2


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    texts: dict[str, str],
    partially_written: Callable[[], None] | None = None,
) -> None:
    """Writes a complete checkpoint to a local folder; `texts` are extra files by name
    (tokenizer, config)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model_state(model), str(directory / MODEL_FILE))
    if partially_written is not None:
        partially_written()  # a chaos test's moment to kill the writer
    torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
    for name, text in texts.items():
        (directory / name).write_text(text, encoding="utf-8")
    files = file_listing(directory)
    (directory / MARKER_FILE).write_text(json.dumps({"files": files}, indent=1))


def upload_checkpoint(
    local: Path,
    destination: str,
    retry_for_s: float,
    deadline: float | None = None,
    gather_parts: int = 0,
) -> None:
    """Copies a checkpoint folder to `destination` (a local path or a bucket URI), its markers
    last. A failed copy is retried with backoff for up to `retry_for_s` seconds (or until the
    wall-clock `deadline`), then raises: the checkpoint stays incomplete there, never loaded.

    `gather_parts`: this is rank 0's part of a sharded checkpoint written by that many ranks;
    once every rank's part marker is at `destination`, it writes the COMPLETE marker listing
    all their files (waiting no longer than the retries would)."""
    fs, inner = filesystem(destination)
    files = sorted(p for p in local.iterdir() if p.is_file())
    give_up = time.time() + retry_for_s
    if deadline is not None:
        give_up = min(give_up, deadline)
    if not is_uri(destination):
        fs.create_dir(inner, recursive=True)
    last = sorted((p for p in files if is_marker(p.name)), key=lambda p: p.name == MARKER_FILE)
    for path in [*(p for p in files if p not in last), *last]:
        retrying(
            lambda path=path: _copy(path, fs, f"{inner}/{path.name}"),
            f"upload of {path.name} to {destination}",
            give_up,
        )
    if gather_parts:
        listing = _gathered_parts(destination, gather_parts, give_up)
        marker = json.dumps({"files": listing}, indent=1).encode()
        retrying(
            lambda: _write(marker, fs, f"{inner}/{MARKER_FILE}"),
            f"writing {MARKER_FILE} in {destination}",
            give_up,
        )


def _gathered_parts(destination: str, ranks: int, give_up: float) -> dict[str, dict]:
    """All ranks' file listings, once every part marker is there."""
    pending, listing = set(range(ranks)), {}
    while True:
        for rank in sorted(pending):
            with contextlib.suppress(OSError, ValueError):
                text = read_file(destination, part_marker(rank))
                if text is not None:
                    listing.update(json.loads(text)["files"])
                    pending.discard(rank)
        if not pending:
            return listing
        if time.time() > give_up:
            raise OSError(
                f"checkpoint {destination}: ranks {sorted(pending)} did not finish their part"
            )
        time.sleep(PART_WAIT_POLL_S)


def _write(data: bytes, fs: pafs.FileSystem, target: str) -> None:
    with fs.open_output_stream(target) as dst:
        dst.write(data)


def _copy(path: Path, fs: pafs.FileSystem, target: str) -> None:
    with open(path, "rb") as src, fs.open_output_stream(target) as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
