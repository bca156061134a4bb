"""Sharded checkpoints (FSDP), written with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the weights and the AdamW state into its own local folder
(`__<rank>_0.distcp`; rank 0 adds DCP's `.metadata`, which maps every tensor's pieces to files
and offsets, and the train state, tokenizer and config). Each rank then lists what it wrote in
a part marker, `PART-<rank>`, written last. The folders are uploaded into one checkpoint folder,
where rank 0 writes the COMPLETE marker once every rank's part marker is there (see
checkpoint.upload_checkpoint): the same completeness rule as an unsharded checkpoint.

Loading goes through DCP too: each rank asks for the pieces its own shards need, whatever the
world size that wrote them, so a checkpoint written by 4 workers loads on 2, 1 or 3.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from raytrain_lm.checkpoints import (
    MODEL_FILE,
    STATE_FILE,
    TrainState,
    file_listing,
    local_copy,
    part_marker,
    read_state,
    tied_aliases,
)

DCP_METADATA = ".metadata"


def is_sharded_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / DCP_METADATA).is_file()


def save_sharded_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    texts: dict[str, str],
    rank: int,
    full_weights: bool,
) -> None:
    """Every rank calls this (it is a collective). With `full_weights`, rank 0 also writes the
    whole model as safetensors (for `generate`, MLflow and export): gathered to its host memory."""
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optimizer_state},
        storage_writer=FileSystemWriter(str(directory)),
    )
    weights = None
    if full_weights:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)  # whole on rank 0, empty elsewhere
    if rank == 0:
        if weights is not None:
            for alias in tied_aliases(model):
                weights.pop(alias, None)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / MODEL_FILE))
        (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
        for name, text in texts.items():
            (directory / name).write_text(text, encoding="utf-8")
    listing = file_listing(directory)
    (directory / part_marker(rank)).write_text(json.dumps({"files": listing}, indent=1))


def load_sharded_checkpoint(
    location: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> TrainState:
    """Every rank calls this: each loads its own shards, resharding from the saved layout."""
    with local_copy(location) as folder:
        if optimizer is None:
            wanted = {"model": model.state_dict()}
            dcp.load(wanted, storage_reader=FileSystemReader(str(folder)))
            model.load_state_dict(wanted["model"])
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            wanted = {"model": model_state, "optim": optimizer_state}
            dcp.load(wanted, storage_reader=FileSystemReader(str(folder)))
            set_state_dict(
                model,
                optimizer,
                model_state_dict=wanted["model"],
                optim_state_dict=wanted["optim"],
            )
        return read_state(folder)


def consolidated_weights(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights from a sharded checkpoint, in one process (no process group):
    `model` is an unsharded instance of the architecture, used for the names and shapes."""
    wanted = {"model": model.state_dict()}
    with warnings.catch_warnings():  # that there is no process group: there is meant to be none
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return wanted["model"]
