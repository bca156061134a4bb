"""A run directory's checkpoints: which are complete, the newest, the best, and pruning the
rest."""

from __future__ import annotations

import contextlib
from pathlib import Path

from raytrain_lm.checkpoints.contents import KEEP_FILE, MARKER_FILE, TrainState
from raytrain_lm.checkpoints.markers import is_complete, read_file
from raytrain_lm.checkpoints.reading import read_state
from raytrain_lm.rundir import RunDir
from raytrain_lm.storage import Location, filesystem


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
    return any(read_file(p, MARKER_FILE) is not None for p in run_dir.checkpoint_folders())


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
    """Deletes complete checkpoints beyond the newest `keep_last` (and the best by val loss),
    except those kept for a registered model (`KEEP_FILE`: `raytrain-lm promote`).

    Incomplete folders are left alone: one may be an upload still in progress.
    """
    with_states = _complete_with_states(run_dir, remembered=True)
    found = [location for location, _ in with_states]
    keep = set(found[-keep_last:])
    best = _best(with_states) if keep_best else None
    if best is not None:
        keep.add(best)
    removed = []
    for location in (p for p in found if p not in keep):
        if read_file(location, KEEP_FILE) is not None:  # read last: a promotion may be under way
            continue
        _complete_states.pop(location, None)
        fs, inner = filesystem(location)
        with contextlib.suppress(OSError):
            fs.delete_dir(inner)
        removed.append(location)
    return removed
