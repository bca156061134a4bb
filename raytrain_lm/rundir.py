"""The layout of a run's directory, in one place: every file a run keeps and who writes it.

`<output_dir>/<name>/` is a local folder or a prefix in a bucket (`s3://`, `gs://`): on a real
cluster the nodes share nothing but the network, so every process that reads or writes run
state (driver, Ray Train controller, rank 0, the next worker group) goes through this class,
over `pyarrow.fs`. It is written for object-store semantics: no rename, no append, one writer
per object, and a checkpoint's marker written last.

- `checkpoint_*/`: checkpoint folders (see raytrain_lm/checkpoints/ for their contents and marker);
- `config.yaml`: the run's config, secrets redacted (driver, at every start);
- `tokenizer.json`: the tokenizer the data was prepared with (driver);
- `tracking.json`: which MLflow run and store belong to the run (driver);
- `events/`: goodput's event log, one object per event (raytrain_lm/run_events/goodput.py; any writer);
- `heartbeat.json`: rank 0's progress, overwritten as it steps (raytrain_lm/run_events/goodput.py);
- `ledger/`: the sequence positions each rank consumed, one object per rank and interval;
- `summary.json`: the figures of the finished run (driver);
- `STOP`: a stop request from the driver, read by rank 0 (trainer/components/stop_requests.py);
- `checkpoint_manager_snapshot.json`: Ray Train's own list of reported checkpoints;
- `lease/`: the claims of the driver that writes the run, one object each (runlease.py):
  while a run trains, a second run of its name is refused.

Runs written before the event log became one object per event have `events.jsonl` instead;
it is still read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow.fs as pafs

from raytrain_lm.storage import (
    Location,
    filesystem,
    is_uri,
    join,
    retrying,
)

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TRACKING_FILE = "tracking.json"
SUMMARY_FILE = "summary.json"
EVENTS_DIR = "events"
LEGACY_EVENTS_FILE = "events.jsonl"
HEARTBEAT_FILE = "heartbeat.json"
STOP_FILE = "STOP"
LEDGER_DIR = "ledger"
CHECKPOINT_PREFIX = "checkpoint_"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"
LEASE_DIR = "lease"

T = TypeVar("T")


@dataclass(frozen=True)
class RunDir:
    """A run's directory: an absolute local path or a bucket URI (`s3://bucket/runs/NAME`)."""

    location: str

    @classmethod
    def of(cls, output_dir: str | Path, name: str) -> RunDir:
        return cls(join(output_dir, name))

    @classmethod
    def coerce(cls, run_dir: RunDir | str | Path) -> RunDir:
        return run_dir if isinstance(run_dir, RunDir) else cls(str(run_dir))

    @property
    def remote(self) -> bool:
        return is_uri(self.location)

    @property
    def parent(self) -> Location:
        return Location(self.location).parent

    @property
    def name(self) -> str:
        return Location(self.location).name

    def __str__(self) -> str:
        return self.location

    def at(self, *parts: str) -> Location:
        """The location of a file or folder inside the run directory."""
        return join(self.location, *parts)

    # ------------------------------------------------------------------------ files

    def _inner(self, *parts: str) -> tuple[pafs.FileSystem, str]:
        fs, root = filesystem(self.location)
        return fs, "/".join([root, *parts])

    def _patiently(self, action: Callable[[], T], what: str) -> T:
        # A bucket may be away for a while; a local disk's errors do not go away by waiting.
        return retrying(action, what) if self.remote else action()

    def read_bytes(self, *parts: str) -> bytes | None:
        fs, inner = self._inner(*parts)

        def read() -> bytes | None:
            try:
                with fs.open_input_stream(inner) as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self._patiently(read, f"reading {self.at(*parts)}")

    def read_text(self, *parts: str) -> str | None:
        data = self.read_bytes(*parts)
        return None if data is None else data.decode("utf-8")

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Replaces the file whole: readers see the old or the new content, never half.
        (An object store's PUT is atomic; on a disk, a temp file is renamed over it.)"""
        fs, inner = self._inner(*parts)
        if self.remote:

            def put() -> None:
                with fs.open_output_stream(inner) as f:
                    f.write(data)

            retrying(put, f"writing {self.at(*parts)}")
            return
        folder = os.path.dirname(inner)
        os.makedirs(folder, exist_ok=True)
        # Not mkstemp: its files are private (0600); this one gets the umask's permissions.
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, inner)

    def write_text(self, text: str, *parts: str) -> None:
        self.write_bytes(text.encode("utf-8"), *parts)

    def exists(self, *parts: str) -> bool:
        fs, inner = self._inner(*parts)
        return self._patiently(
            lambda: fs.get_file_info(inner).type != pafs.FileType.NotFound,
            f"looking for {self.at(*parts)}",
        )

    def delete(self, *parts: str) -> None:
        fs, inner = self._inner(*parts)

        def delete() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(inner)

        self._patiently(delete, f"deleting {self.at(*parts)}")

    def list_files(self, *folder: str) -> list[str]:
        """Names of the files directly in `folder` (none if it does not exist), sorted."""
        return [i.base_name for i in self._list(*folder) if i.type == pafs.FileType.File]

    def _list(self, *folder: str) -> list[pafs.FileInfo]:
        fs, inner = self._inner(*folder)
        selector = pafs.FileSelector(inner, allow_not_found=True)
        infos = self._patiently(lambda: fs.get_file_info(selector), f"listing {self.at(*folder)}")
        return sorted(infos, key=lambda i: i.base_name)

    def new_object_name(self, suffix: str) -> str:
        """A name that sorts by creation time and that no other writer can take."""
        return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}{suffix}"

    @contextlib.contextmanager
    def local_files(self, *names: str) -> Iterator[list[Path]]:
        """Local paths holding the named files (for APIs that read local files, such as
        MLflow's artifact upload): the files themselves, or copies that last the block."""
        if not self.remote:
            yield [Path(self.location, name) for name in names]
            return
        folder = Path(tempfile.mkdtemp(prefix="raytrain-run-files-"))
        try:
            for name in names:
                (folder / name).write_bytes(self.read_bytes(name) or b"")
            yield [folder / name for name in names]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def create(self) -> None:
        """Makes the folder on a disk (a bucket prefix exists once it holds an object)."""
        if not self.remote:
            Path(self.location).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------------ layout

    def checkpoint_folders(self) -> list[Location]:
        return [
            self.at(i.base_name)
            for i in self._list()
            if i.type == pafs.FileType.Directory and i.base_name.startswith(CHECKPOINT_PREFIX)
        ]

    def is_run(self) -> bool:
        """Whether a run was ever started here (it has a tracking record or events)."""
        return (
            self.exists(TRACKING_FILE)
            or bool(self.list_files(EVENTS_DIR))
            or self.exists(LEGACY_EVENTS_FILE)
        )
