"""Locations that may be local paths or on any `pyarrow.fs` filesystem (`s3://`, `gs://`,
`file://`), and the checks that a bucket can be used, in one place.

Credentials and endpoints come from the standard environment (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_PROFILE`, instance profiles, workload
identity), through pyarrow and the cloud SDKs it wraps; never from a config.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError

_OBJECT_STORES = ("s3", "gcs")  # pyarrow type names of the filesystems with buckets
PROBE_PREFIX = ".raytrain-probe-"

# How long a read or write of run state waits out a bucket that does not answer (an outage,
# a network partition) before it fails; see `retrying`.
OUTAGE_RETRY_S = 600.0

T = TypeVar("T")


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


@functools.lru_cache(maxsize=16)
def _bucket_filesystem(root: str) -> pafs.FileSystem:
    # Creating an S3 filesystem looks up the bucket's region: once per process and bucket.
    return pafs.FileSystem.from_uri(root)[0]


def filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI."""
    path = str(path)
    if not is_uri(path):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    parts = urlsplit(path)
    if parts.scheme == "file":
        return pafs.LocalFileSystem(), parts.path
    fs = _bucket_filesystem(f"{parts.scheme}://{parts.netloc}")
    return fs, f"{parts.netloc}{parts.path}".rstrip("/")


class Location(str):
    """A local path or a bucket URI, as a string with a path's `name`, `parent` and `/`."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.rstrip("/").rsplit("/", 1)[0])

    def __truediv__(self, part: str) -> Location:
        return join(self, part)


def join(base: str | Path, *parts: str) -> Location:
    return Location("/".join([str(base).rstrip("/"), *parts]))


def retrying(action: Callable[[], T], what: str, give_up_at: float | None = None) -> T:
    """Runs `action`, retrying an OSError with backoff (1 s doubling to 30 s) until the wall
    clock passes `give_up_at` (default: OUTAGE_RETRY_S from now); says so at each retry."""
    give_up_at = give_up_at if give_up_at is not None else time.time() + OUTAGE_RETRY_S
    wait = 1.0
    while True:
        try:
            return action()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if time.time() + wait > give_up_at:
                raise OSError(f"{what} failed, retries exhausted: {exc}") from exc
            reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            print(
                f"[raytrain-lm] {what} failed ({reason}); retrying in {wait:.0f} s",
                file=sys.__stdout__,
                flush=True,
            )
            time.sleep(wait)
            wait = min(wait * 2, 30.0)


def read_bytes(path: str | Path) -> bytes:
    fs, inner = filesystem(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


def read_range(path: str | Path, offset: int, size: int) -> bytes:
    """`size` bytes of a file from `offset` (one ranged GET on an object store)."""
    fs, inner = filesystem(path)
    with fs.open_input_file(inner) as f:
        data = f.read_at(size, offset)
    if len(data) != size:
        raise OSError(f"{path}: {len(data)} bytes at {offset}, expected {size}")
    return data


def write_bytes(path: str | Path, data: bytes) -> None:
    fs, inner = filesystem(path)
    with fs.open_output_stream(inner) as f:
        f.write(data)


def exists(path: str | Path) -> bool:
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def makedirs(path: str | Path) -> None:
    """Creates a folder and its parents on a file system that has folders; nothing on an
    object store, whose "folders" are key prefixes that exist with their first object."""
    fs, inner = filesystem(path)
    if fs.type_name not in _OBJECT_STORES:
        fs.create_dir(inner, recursive=True)


def delete_tree(path: str | Path) -> None:
    """Deletes a folder (or every object under a prefix) and what it holds; none is fine."""
    if not is_uri(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_dir(inner)


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"


def _missing_credentials() -> str | None:
    """What is missing from half-set S3 credentials in the environment (None: nothing
    visibly missing; credentials may still come from a profile or the instance)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and not secret:
        return "AWS_SECRET_ACCESS_KEY is not set (AWS_ACCESS_KEY_ID is)"
    if secret and not key:
        return "AWS_ACCESS_KEY_ID is not set (AWS_SECRET_ACCESS_KEY is)"
    return None


def _no_credentials_found() -> bool:
    sources = (
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    )
    metadata_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    return (
        metadata_off
        and not any(os.environ.get(v) for v in sources)
        and not Path("~/.aws/credentials").expanduser().exists()
    )


def _reason(exc: BaseException) -> str:
    """pyarrow's S3 error, shortened to what a user acts on: 'AWS Error NETWORK_CONNECTION
    during HeadBucket operation: curlCode: 7, ...; Details: Failed to connect to ...'."""
    text = " ".join(str(exc).split())
    details = re.search(r"Details: (.*)$", text)
    if details:
        return details.group(1)
    operation = re.search(r"operation: (.*)$", text)
    return operation.group(1) if operation else text


def check_reachable(uri: str, setting: str) -> None:
    """Refuses, in one line naming `setting`, the URI and its bucket, a location on an object
    store whose bucket does not exist, cannot be reached or refuses these credentials. A local
    path or `file://` URI is not checked (writing to it reports its own errors)."""
    if not is_uri(uri):
        return
    where = f"{setting} {uri}"
    try:
        fs, inner = filesystem(uri)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{where}: {_reason(exc)}") from None
    if fs.type_name not in _OBJECT_STORES:
        return
    bucket = inner.split("/", 1)[0]
    if fs.type_name == "s3":
        missing = _missing_credentials()
        if missing:
            raise UserError(f"{where}: cannot access bucket {bucket}: {missing}")
    try:
        info = fs.get_file_info(bucket)
    except OSError as exc:
        text = str(exc)
        if "ACCESS_DENIED" in text or "403" in text or "Forbidden" in text:
            hint = (
                "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE, or use an instance profile or workload identity)"
                if fs.type_name == "s3" and _no_credentials_found()
                else "access denied for these credentials"
            )
            raise UserError(f"{where}: cannot access bucket {bucket}: {hint}") from None
        endpoint = f" at {_endpoint()}" if fs.type_name == "s3" else ""
        raise UserError(
            f"{where}: cannot reach bucket {bucket}{endpoint}: {_reason(exc)}"
        ) from None
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"{where}: bucket {bucket} does not exist")


def check_writable(uri: str, setting: str) -> None:
    """`check_reachable`, then writes and deletes one small object under `uri`: a bucket that
    can be listed but not written (a read-only role) is refused now, not at the first
    checkpoint."""
    check_reachable(uri, setting)
    if not is_uri(uri):
        return
    fs, inner = filesystem(join(uri, f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"))
    try:
        with fs.open_output_stream(inner) as f:
            f.write(b"probe")
        fs.delete_file(inner)
    except OSError as exc:
        text = str(exc)
        reason = (
            "access denied for these credentials"
            if "ACCESS_DENIED" in text or "403" in text or "Forbidden" in text
            else _reason(exc)
        )
        raise UserError(f"{setting} {uri}: cannot write to the bucket: {reason}") from None
