"""What a tracker could not store yet, and the background thread that stores it.

A log call never waits on the store: metrics wait here and go in batches, as do checkpoints
logged as models, and params, tags, dataset inputs and artifacts that failed to go at once.
While the store is down the thread retries with a backoff that grows with the outage, warns
when the outage begins and says when it ends, and keeps the unsent metrics in this process's
spool file (spool.py).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from raytrain_lm.tracking.spool import own_spool, spooled_by_others, write_spool
from raytrain_lm.tracking.store import is_permanent


class BufferedSender:
    def __init__(self, client, uri: str, run_id: str):
        self.client = client
        self.uri, self.run_id = uri, run_id
        self._pending: list = []  # metrics not yet stored, oldest first
        self._logged_through = -1  # the highest step of any metric logged so far
        # Another chief's steps this one logs only where the store lacks them (log_missing)
        self._unless_stored: list = []
        self._artifacts: list[tuple[str, str | None]] = []  # artifacts that failed to upload
        self._params: list = []  # params, tags and inputs that could not be logged yet
        self._tags: list = []
        self._inputs: list = []
        self._models: list = []  # checkpoints to log as models (models.py), in order
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._attempted = threading.Condition(self._lock)
        self._attempts = 0
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._spool = own_spool(run_id)

    def _log_now_or_later(self, kind: str, items: list) -> None:
        try:
            self._log_batch(kind, items)
        except Exception as exc:
            if is_permanent(exc):
                raise
            self._note_failure(exc)
            with self._lock:
                getattr(self, kind).extend(items)
            self._ensure_thread()

    def _log_batch(self, kind: str, items: list) -> None:
        for i in range(0, len(items), 100):
            chunk = items[i : i + 100]
            try:
                if kind == "_models":
                    self._log_models(chunk)
                elif kind == "_params":
                    self.client.log_batch(self.run_id, params=chunk)
                elif kind == "_inputs":
                    self.client.log_inputs(self.run_id, datasets=chunk)
                else:
                    self.client.log_batch(self.run_id, tags=chunk)
            except Exception as exc:  # same params logged by an earlier attempt of this run
                if "already logged" not in str(exc) and "Changing param" not in str(exc):
                    raise

    def _log_models(self, models: list) -> None:
        from raytrain_lm.tracking.models import log_checkpoint_model

        for model in models:
            try:
                log_checkpoint_model(self.client, self.run_id, model)
            except Exception as exc:
                if not is_permanent(exc):
                    raise
                print(f"[raytrain-lm] warning: MLflow refused the model of step {model.step}: "
                      f"{exc}", file=sys.stderr, flush=True)  # fmt: skip

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name=f"mlflow-{self.run_id[:8]}", daemon=True
            )
            self._thread.start()

    def _attempt_and_wait(self, timeout: float) -> None:
        self._ensure_thread()
        with self._lock:
            if not self._unsent():
                return
            target = self._attempts + 1
            self._retry_at = 0.0  # an explicit flush tries now, backoff or not
        self._wake.set()
        with self._attempted:
            self._attempted.wait_for(lambda: self._attempts >= target, timeout=timeout)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            with self._lock:
                idle = not self._unsent()
                waiting = time.monotonic() < self._retry_at
            if idle or waiting:
                continue
            self._send_all()

    def _unsent(self) -> int:
        kept = len(self._params) + len(self._tags) + len(self._inputs) + len(self._models)
        return len(self._pending) + len(self._artifacts) + len(self._unless_stored) + kept

    def _send_all(self) -> None:
        """One attempt to store everything unsent; flush and finish wait for it to end."""
        try:
            self._send_kept()
            self._queue_missing()
            sent = self._send_metrics()
            self._send_artifacts()
        except Exception as exc:
            self._note_failure(exc)
            self._write_spool()
        else:
            self._note_sent(sent)
        with self._attempted:
            self._attempts += 1
            self._attempted.notify_all()

    def _send_kept(self) -> None:
        for kind in ("_params", "_tags", "_inputs", "_models"):
            with self._lock:
                items = list(getattr(self, kind))
            if items:
                self._log_batch(kind, items)
                with self._lock:
                    del getattr(self, kind)[: len(items)]

    def _queue_missing(self) -> None:
        """Moves the `log_missing` candidates that the store lacks to the front of the queue."""
        with self._lock:
            candidates = list(self._unless_stored)
        if not candidates:
            return
        stored: dict[str, set[int]] = {}
        for key in {m.key for m in candidates}:
            stored[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
        missing = [m for m in candidates if m.step not in stored[m.key]]
        with self._lock:
            self._pending[:0] = missing
            del self._unless_stored[: len(candidates)]

    def _send_metrics(self) -> int:
        """Stores the pending metrics, oldest first; returns how many went."""
        sent = 0
        while True:
            with self._lock:
                chunk = self._pending[:1000]
            if not chunk:
                return sent
            try:
                self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as exc:
                if not is_permanent(exc):
                    raise
                print(f"[raytrain-lm] warning: dropped metrics MLflow refused: {exc}")
            with self._lock:
                del self._pending[: len(chunk)]
            sent += len(chunk)

    def _send_artifacts(self) -> None:
        while True:
            with self._lock:
                if not self._artifacts:
                    return
                path, artifact_path = self._artifacts[0]
            if Path(path).exists():
                self.client.log_artifact(self.run_id, path, artifact_path)
            with self._lock:
                self._artifacts.pop(0)

    def _note_sent(self, sent: int) -> None:
        if self._down_since is not None:
            print(
                f"[raytrain-lm] tracking store {self.uri} reachable again after "
                f"{time.monotonic() - self._down_since:.0f} s; sent {sent} buffered metrics",
                file=sys.stderr,
                flush=True,
            )
            self._down_since = None
        self._spool.unlink(missing_ok=True)

    def _note_failure(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            print(
                f"[raytrain-lm] warning: tracking store {self.uri} unreachable "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                "training continues, metrics are buffered and retried",
                file=sys.stderr,
                flush=True,
            )
        outage = now - self._down_since
        self._retry_at = now + min(30.0, 2.0 + outage / 4)

    def _write_spool(self) -> None:
        with self._lock:
            unsent = list(self._pending)
        write_spool(self._spool, unsent)

    def _adopt_spools(self) -> None:
        """Takes over metrics spooled by earlier processes of this run (a worker that ended
        while the store was down). Only the driver calls this, while no worker is logging."""
        for file, metrics in spooled_by_others(self.run_id, self._spool):
            with self._lock:
                self._pending[:0] = metrics
            file.unlink(missing_ok=True)
        if self._pending:
            self._write_spool()
