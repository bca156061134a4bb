"""The replica groups' chief uploads its checkpoints itself (trainer/groups/replicas.py): replica
groups report nothing to Ray Train, whose report waits for every worker. Periodic uploads run
on background threads, one after another; in a sweep trial each checkpoint's report goes to
Tune after its upload, in step order (Tune takes a trial's reports in that order)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_lm.trainer.progress import announce

# Where a sweep trial's report carries the checkpoint it stands for (the trial's own Tune
# checkpoint holds this file, pointing at the run's checkpoint rather than copying it).
POINTER_FILE = "train_checkpoint.json"


class ChiefUploads:
    def __init__(self, reports: Any | None):
        self.reports = reports  # the trial's queue to Tune, in a sweep
        self.threads: list[threading.Thread] = []

    def publish(
        self, local: Path, name: str, report: dict[str, float], wait: bool,
        upload: Callable[[Path, str], str],
    ) -> None:  # fmt: skip
        """`upload`: (local folder, name) -> where it went."""
        previous = self.threads[-1] if self.threads else None
        if wait:
            self.join()
            self._upload_and_report(upload, local, name, report, None)
            return
        thread = threading.Thread(
            target=self._upload_and_report,
            args=(upload, local, name, report, previous),
            name="upload",
            daemon=True,
        )
        thread.start()
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _upload_and_report(
        self, upload, local: Path, name: str, report: dict[str, float],
        previous: threading.Thread | None,
    ) -> None:  # fmt: skip
        try:
            location = upload(local, name)
        except OSError as exc:
            announce(f"checkpoint {name} was not uploaded: {exc}")
            return
        finally:
            shutil.rmtree(local, ignore_errors=True)
        if self.reports is None:
            return
        if previous is not None:
            previous.join()
        # Blocks until the trial took the previous report, as ReportToTune's put does.
        self.reports.put({**report, POINTER_FILE: location})
