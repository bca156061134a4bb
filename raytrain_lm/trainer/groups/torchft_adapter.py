"""Every use of torchft's private attributes, in one place.

torchft 0.2 has no public way to do these; its current source (meta-pytorch/torchft, read
2026-12-06) still has none. Each function says why we need it and what it touches. The
`check_*` functions fail with a message naming what changed when an installed torchft no
longer has it: replica groups call them on their own Manager, DiLoCo and LocalSGD as they
build them, and tests/test_torchft_adapter.py on real ones, so a newer torchft fails there
first.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

CHECKED_VERSION = "0.2.0"


def forget_failed_quorum(manager: Any) -> None:
    """A quorum attempt that timed out stays in `Manager._quorum_future`, and every later
    `start_quorum` raises it again: forgetting it is what lets a new attempt be made."""
    manager._quorum_future = None


def forget_failed_sync(manager: Any) -> None:
    """A failed sync's error stays in `Manager._errored` until the next `start_quorum`, and
    every all-reduce and commit fails until then. Streaming DiLoCo syncs a unit's fragments on
    the quorum of the unit's start, without a new quorum: the error of the sync before is
    cleared here (errors of the process group itself still reach each commit)."""
    manager._errored = None


def diloco_fragments(diloco: Any) -> list[Any]:
    """`DiLoCo._fragments`: each fragment's `prepare_sync`, `perform_sync`, `save_parameters`
    and `restore_parameters` (public methods of the fragment) are driven by us, so that syncs
    happen where our commit units need them, not where DiLoCo's optimizer hook puts them."""
    return diloco._fragments


def average_parameters(local_sgd: Any) -> list[Any]:
    """`LocalSGD._average`: the model's parameters averaged over the quorum. Its public `sync`
    would also form a quorum and commit on its own; our rounds form the quorum and vote
    themselves, after checking that every position was taken once (syncs/rounds.py)."""
    return local_sgd._average()


def check_manager(manager: Any) -> None:
    _raise_if_missing(
        [f"Manager.{name}" for name in ("_quorum_future", "_errored") if not hasattr(manager, name)]
    )


def check_diloco(diloco: Any) -> None:
    fragments = getattr(diloco, "_fragments", None)
    if not isinstance(fragments, list):
        _raise_if_missing(["DiLoCo._fragments"])
    missing = [
        f"DiLoCo fragment.{name}"
        for fragment in fragments
        for name in ("prepare_sync", "perform_sync", "save_parameters", "restore_parameters")
        if not callable(getattr(fragment, name, None))
    ]
    _raise_if_missing(missing)


def check_local_sgd(local_sgd: Any) -> None:
    _raise_if_missing(
        [] if callable(getattr(local_sgd, "_average", None)) else ["LocalSGD._average"]
    )


def _raise_if_missing(missing: list[str]) -> None:
    if missing:
        version = importlib.metadata.version("torchft")
        raise RuntimeError(
            f"torchft {version} lacks {', '.join(sorted(set(missing)))}, which "
            "raytrain_lm/trainer/groups/torchft_adapter.py uses (checked against torchft "
            f"{CHECKED_VERSION}): see that module for what each is for"
        )
