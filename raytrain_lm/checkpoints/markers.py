"""When a checkpoint is complete, and when it is damaged.

A checkpoint is complete once its COMPLETE marker exists and every file the marker lists is
there at its recorded size; the marker is written last, and listing the files also covers
copies that do not keep the write order (Ray uploads a checkpoint's files in no particular
order). A sharded checkpoint is written by every rank: each lists its own files in a part
marker, and the COMPLETE marker, listing them all, follows the last part.

Complete is not the same as loadable: a file can keep its size and still be damaged. The
marker therefore records each file's SHA-256 too, and a restore verifies them (`damage`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_lm.checkpoints.contents import MARKER_FILE, PART_PREFIX
from raytrain_lm.storage import filesystem

_HASH_CHUNK = 1 << 22


def part_marker(rank: int) -> str:
    return f"{PART_PREFIX}{rank}"


def is_marker(name: str) -> bool:
    return name == MARKER_FILE or name.startswith(PART_PREFIX)


def file_listing(directory: Path) -> dict[str, dict]:
    """Every file of a local checkpoint folder but the markers: name -> size and SHA-256."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and not is_marker(p.name)
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_file(location: str, name: str) -> bytes | None:
    fs, inner = filesystem(location)
    try:
        with fs.open_input_stream(f"{inner}/{name}") as f:
            return f.read()
    except FileNotFoundError:
        return None


def listed_files(location: str) -> dict[str, dict] | None:
    try:
        files = json.loads(read_file(location, MARKER_FILE) or b"")["files"]
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
    files = listed_files(location)
    if files is None:
        return False
    sizes = _sizes(location)
    return all(sizes.get(name) == facts["size"] for name, facts in files.items())


def damage(directory: str | Path) -> str | None:
    """What is wrong with a checkpoint in a local folder (a file missing, cut short or
    altered), or None."""
    directory = Path(directory)
    files = listed_files(str(directory))
    if files is None:
        return f"no readable {MARKER_FILE} marker"
    for name, facts in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != facts["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {facts['size']}"
        if "sha256" in facts and sha256(path) != facts["sha256"]:
            return f"{name} does not match its checksum"
    return None
