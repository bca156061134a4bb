"""Checkpoint contents and atomicity.

A checkpoint directory holds the weights (safetensors), the optimizer state, the train state
(step, tokens, data position), and the tokenizer and config that make it usable on its own.
It is complete once its COMPLETE marker exists and every file the marker lists is there at
its recorded size; the marker is written last, and listing the files also covers copies that
do not keep the write order (Ray uploads a checkpoint's files in no particular order). A
sharded checkpoint (sharded.py) is written by every rank: each lists its own files in a part
marker, and the COMPLETE marker, listing them all, follows the last part.

Complete is not the same as loadable: a file can keep its size and still be damaged. The
marker therefore records each file's SHA-256 too, and a restore verifies them; a checkpoint
that fails verification or loading is skipped for the one before it (`restore_newest`).

Checkpoints are written to a local folder, then uploaded into the run directory (a local
folder or a bucket) by `upload_checkpoint`, which retries while the bucket is away and writes
the marker last. Reading one from a bucket downloads it to a local folder first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import load_file, save_file

from raytrain_lm.errors import UserError
from raytrain_lm.rundir import CONFIG_FILE as CONFIG_FILE  # callers still import it from here
from raytrain_lm.rundir import RunDir
from raytrain_lm.storage import Location, filesystem, is_uri, retrying

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
MARKER_FILE = "COMPLETE"
PART_PREFIX = "PART-"  # one rank's listing of the files it wrote into a sharded checkpoint
PART_WAIT_POLL_S = 0.2
_HASH_CHUNK = 1 << 22
DOWNLOAD_CHUNK = 1 << 26  # 64 MiB per ranged GET (and per copying thread's buffer)


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


def part_marker(rank: int) -> str:
    return f"{PART_PREFIX}{rank}"


def _is_marker(name: str) -> bool:
    return name == MARKER_FILE or name.startswith(PART_PREFIX)


def file_listing(directory: Path) -> dict[str, dict]:
    """Every file of a local checkpoint folder but the markers: name -> size and SHA-256."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and not _is_marker(p.name)
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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


# ---------------------------------------------------------------------------- upload


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
    last = sorted((p for p in files if _is_marker(p.name)), key=lambda p: p.name == MARKER_FILE)
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
                text = _read(destination, part_marker(rank))
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


# ---------------------------------------------------------------------------- reading


def _read(location: str, name: str) -> bytes | None:
    fs, inner = filesystem(location)
    try:
        with fs.open_input_stream(f"{inner}/{name}") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _listed_files(location: str) -> dict[str, dict] | None:
    try:
        files = json.loads(_read(location, MARKER_FILE) or b"")["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # Markers written before checksums were recorded list sizes only.
    return {k: v if isinstance(v, dict) else {"size": v} for k, v in files.items()}


def _sizes(location: str) -> dict[str, int]:
    fs, inner = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}


def is_complete(location: str | Path) -> bool:
    """Marker present and every listed file there at its size (cheap: no reading)."""
    location = str(location)
    files = _listed_files(location)
    if files is None:
        return False
    sizes = _sizes(location)
    return all(sizes.get(name) == facts["size"] for name, facts in files.items())


def damage(directory: str | Path) -> str | None:
    """What is wrong with a checkpoint in a local folder (a file missing, cut short or
    altered), or None."""
    directory = Path(directory)
    files = _listed_files(str(directory))
    if files is None:
        return f"no readable {MARKER_FILE} marker"
    for name, facts in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != facts["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {facts['size']}"
        if "sha256" in facts and _sha256(path) != facts["sha256"]:
            return f"{name} does not match its checksum"
    return None


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
    return TrainState(**json.loads(_read(str(location), STATE_FILE) or b""))


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


def complete_checkpoints(run_dir: RunDir | str | Path) -> list[Location]:
    """Complete checkpoint folders in a run directory, oldest step first."""
    return [location for location, _ in _complete_with_states(run_dir)]


def latest_complete_checkpoint(run_dir: RunDir | str | Path) -> Location | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def ever_checkpointed(run_dir: RunDir | str | Path) -> bool:
    """Whether any checkpoint of this run was finished once (its marker was written), even if
    none is complete or loadable now: starting such a run from step 0 would be wrong."""
    run_dir = RunDir.coerce(run_dir)
    return any(_read(p, MARKER_FILE) is not None for p in run_dir.checkpoint_folders())


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


# A complete checkpoint does not change until it is pruned: what a prune read about one (its
# marker, its state) holds for the next prune, which then lists the run directory and reads
# only the new checkpoint. In a bucket that is a handful of requests, not a few per checkpoint.
_complete_states: dict[str, TrainState] = {}


def _complete_with_states(
    run_dir: RunDir | str | Path, remembered: bool = False
) -> list[tuple[Location, TrainState]]:
    """Complete checkpoints with their train states, oldest step first; each marker and
    state is read once (`remembered`: once per process, see _complete_states)."""
    with_states = []
    for folder in RunDir.coerce(run_dir).checkpoint_folders():
        location = Location(str(folder))
        state = _complete_states.get(location) if remembered else None
        if state is None:
            if not is_complete(location):
                continue
            state = read_state(location)
            if remembered:
                _complete_states[location] = state
        with_states.append((location, state))
    return sorted(with_states, key=lambda item: (item[1].step, item[0].name))


def _best(with_states: list[tuple[Location, TrainState]]) -> Location | None:
    scored = [
        (state.val_loss, state.step, location)
        for location, state in with_states
        if state.val_loss is not None and state.val_step == state.step
    ]
    return min(scored)[2] if scored else None


def best_checkpoint(run_dir: RunDir | str | Path) -> Location | None:
    """The complete checkpoint with the lowest val loss measured at its own step."""
    return _best(_complete_with_states(run_dir))


def prune_checkpoints(run_dir: RunDir | str | Path, keep_last: int, keep_best: bool) -> list[str]:
    """Deletes complete checkpoints beyond the newest `keep_last` (and the best by val loss).

    Incomplete folders are left alone: one may be an upload still in progress.
    """
    with_states = _complete_with_states(run_dir, remembered=True)
    found = [location for location, _ in with_states]
    keep = set(found[-keep_last:])
    best = _best(with_states) if keep_best else None
    if best is not None:
        keep.add(best)
    removed = [p for p in found if p not in keep]
    for location in removed:
        _complete_states.pop(location, None)
        fs, inner = filesystem(location)
        with contextlib.suppress(OSError):
            fs.delete_dir(inner)
    return removed
