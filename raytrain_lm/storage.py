"""Paths that may be local or on any `pyarrow.fs` filesystem (`s3://`, `gs://`, `file://`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(str(path))
    return pafs.LocalFileSystem(), str(Path(path).expanduser().absolute())


def join(base: str | Path, *parts: str) -> str:
    return "/".join([str(base).rstrip("/"), *parts])


def read_bytes(path: str | Path) -> bytes:
    fs, inner = filesystem(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


def write_bytes(path: str | Path, data: bytes) -> None:
    fs, inner = filesystem(path)
    with fs.open_output_stream(inner) as f:
        f.write(data)


def exists(path: str | Path) -> bool:
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound
