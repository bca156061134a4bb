"""Experiment tracking behind one small interface. MLflow is the implementation; only the
driver and rank 0 ever hold a live tracker, every other rank gets `NullTracker`.

A tracking server that goes away must not end a multi-hour run: `MLflowTracker` sends from a
background thread, keeps whatever could not be sent, retries with backoff, warns once per
outage, and spools unsent metrics to local disk so the driver's tracker for the same run can
send them after the worker that logged them is gone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from raytrain_lm.errors import UserError
from raytrain_lm.redaction import redact
from raytrain_lm.tracking_ui import open_experiment
from raytrain_lm.tracking_wait import open_when_reachable

SPOOL_ENV = "RAYTRAIN_LM_TRACKING_SPOOL"


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str | None = "FINISHED") -> None: ...
    @property
    def stored_through(self) -> int: ...
    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None: ...


class NullTracker:
    run_id = None
    stored_through = 2**62  # nothing is kept for a store there is not

    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str | None = "FINISHED") -> None:
        pass


def _spool_dir() -> Path:
    return Path(os.environ.get(SPOOL_ENV) or Path(tempfile.gettempdir()) / "raytrain-lm-spool")


def _retry_on_our_schedule(uri: str) -> None:
    if uri.startswith(("http://", "https://")):
        # We retry on our own schedule (a background thread, or the wait to open a run);
        # MLflow's default of 7 retries with exponential backoff holds each call for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def _check_local_store(uri: str) -> None:
    """A local store that cannot exist is not an outage to wait for: refuse it at once."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
        if path.name != ":memory:" and not path.parent.is_dir():
            raise UserError(f"tracking store {uri}: folder {path.parent} does not exist")


def _permanent(exc: Exception) -> bool:
    """Errors that retrying cannot fix (a deleted run, a malformed value): drop, don't loop."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.get_http_status_code() in (400, 404)


class MLflowTracker:
    """Buffers per-step metrics and writes them in batches so logging never stalls a step."""

    def __init__(self, uri: str, run_id: str, flush_every: int = 50, flush_wait_s: float = 10.0):
        from mlflow.tracking import MlflowClient

        _retry_on_our_schedule(uri)
        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.run_id = uri, run_id
        self._flush_every = flush_every
        self._flush_wait_s = flush_wait_s
        self._pending: list = []  # metrics not yet stored, oldest first
        self._logged_through = -1  # the highest step of any metric logged so far
        # Another chief's steps this one logs only where the store lacks them (log_missing)
        self._unless_stored: list = []
        self._artifacts: list[tuple[str, str | None]] = []  # artifacts that failed to upload
        self._params: list = []  # params, tags and inputs that could not be logged yet
        self._tags: list = []
        self._inputs: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._attempted = threading.Condition(self._lock)
        self._attempts = 0
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._spool = _spool_dir() / f"{run_id}.{os.getpid()}.jsonl"

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None,
        parent_run_id: str | None = None,
        tags: dict[str, Any] | None = None,
        wait_s: float = 600.0,
    ) -> MLflowTracker:
        """Opens `run_id` again when given (a resumed run), else the child of `parent_run_id`
        named `run_name` if one exists (a trial restarted before it recorded its run id), else
        creates a new MLflow run, nested under `parent_run_id` when given.

        A run cannot start without its run id, so while the store is unreachable this waits
        for it, up to `wait_s` (a sweep's trial or a restart during an outage), saying so
        (tracking_wait.py), then raises a `UserError` naming the store and
        `tracking.start_wait_s`."""
        _retry_on_our_schedule(uri)
        _check_local_store(uri)
        tracker = open_when_reachable(
            lambda: cls._open(uri, experiment, run_name, run_id, parent_run_id),
            uri,
            run_name,
            wait_s,
            _permanent,
        )
        if tags:
            tracker.set_tags(tags)
        tracker._adopt_spools()
        return tracker

    @classmethod
    def _open(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None,
        parent_run_id: str | None,
    ) -> MLflowTracker:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        # Also for a resumed run: an experiment made before the training view had no tags.
        experiment_id = open_experiment(client, experiment, uri)
        tracker = None
        if run_id is not None:
            try:
                client.update_run(run_id, status="RUNNING")
                tracker = cls(uri, run_id)
            except Exception as exc:
                if not _permanent(exc):
                    raise  # the store is down: wait for it, do not open a second run
                # the run is gone (a store that was reset): start afresh rather than fail
        if tracker is None:
            existing = []
            if parent_run_id is not None:
                existing = client.search_runs(
                    [experiment_id],
                    f"tags.`mlflow.parentRunId` = '{parent_run_id}' "
                    f"and attributes.run_name = '{run_name}'",
                    max_results=1,
                )
            if existing:
                client.update_run(existing[0].info.run_id, status="RUNNING")
                tracker = cls(uri, existing[0].info.run_id)
            else:
                nested = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
                run = client.create_run(experiment_id, run_name=run_name, tags=nested)
                tracker = cls(uri, run.info.run_id)
        return tracker

    # ------------------------------------------------------------------ params, tags, artifacts

    def log_params(self, params: dict[str, Any]) -> None:
        """Logs now, or keeps them and logs when the store is back."""
        from mlflow.entities import Param

        self._log_now_or_later(
            "_params", [Param(k, str(v)[:6000]) for k, v in redact(params).items()]
        )

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Sets now, or keeps them and sets when the store is back."""
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:5000]) for k, v in redact(tags).items() if v is not None]
        self._log_now_or_later("_tags", items)

    def log_dataset(self, dataset: dict[str, str], context: str = "training") -> None:
        """Logs a dataset input (MLflow's `log_input`: name, digest, source_type, source,
        schema, profile) now, or when the store is back."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        entry = DatasetInput(Dataset(**dataset), tags=[InputTag("mlflow.data.context", context)])
        self._log_now_or_later("_inputs", [entry])

    def _log_now_or_later(self, kind: str, items: list) -> None:
        try:
            self._log_batch(kind, items)
        except Exception as exc:
            if _permanent(exc):
                raise
            self._note_failure(exc)
            with self._lock:
                getattr(self, kind).extend(items)
            self._ensure_thread()

    def _log_batch(self, kind: str, items: list) -> None:
        for i in range(0, len(items), 100):
            chunk = items[i : i + 100]
            try:
                if kind == "_params":
                    self.client.log_batch(self.run_id, params=chunk)
                elif kind == "_inputs":
                    self.client.log_inputs(self.run_id, datasets=chunk)
                else:
                    self.client.log_batch(self.run_id, tags=chunk)
            except Exception as exc:  # same params logged by an earlier attempt of this run
                if "already logged" not in str(exc) and "Changing param" not in str(exc):
                    raise

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Uploads now, or keeps the file's path and uploads when the store is back."""
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as exc:
            if _permanent(exc):
                raise
            self._note_failure(exc)
            with self._lock:
                self._artifacts.append((str(path), artifact_path))
            self._ensure_thread()

    # ------------------------------------------------------------------------------ metrics

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._lock:
            self._pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
            self._logged_through = max(self._logged_through, step)
            due = len(self._pending) >= self._flush_every * max(1, len(metrics))
        if due:
            self._ensure_thread()
            self._wake.set()  # sent by our background thread: a step never waits on MLflow

    @property
    def stored_through(self) -> int:
        """The highest step S such that every metric logged so far at a step up to S is in
        the store (-1: none): what a replica groups' chief tells the others they may forget
        (trainer/quorum.py's ChiefTracker)."""
        with self._lock:
            waiting = [m.step for m in (*self._pending, *self._unless_stored)]
            return min(waiting) - 1 if waiting else self._logged_through

    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Logs each (step, metrics) value whose metric has no value at that step in the
        store yet: a new replica groups' chief logs again what the last one may have logged
        and not stored before it died, and nothing twice. The store is asked from the
        background thread, so an outage only delays it."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(k, float(v), now, step) for step, metrics in steps for k, v in metrics.items()
        ]
        with self._lock:
            self._unless_stored.extend(rows)
            self._logged_through = max([self._logged_through, *(m.step for m in rows)])
        self._ensure_thread()
        self._wake.set()

    def flush(self) -> None:
        """Blocks until every metric logged so far is stored, or until one attempt to store
        them failed (the store is down): they then stay buffered, spooled to disk, and are
        retried in the background."""
        self._attempt_and_wait(self._flush_wait_s)

    def finish(self, status: str | None = "FINISHED", wait_s: float = 120.0) -> None:
        """Sends everything (waiting up to `wait_s` for a store that is down), then ends the
        run with `status`, or leaves its status to its owner when None (a sweep's driver ends
        its trials' runs). A store still down after that gets a warning, not an exception:
        the metrics stay spooled on disk and are sent by the next tracker opened for this
        run."""
        self._adopt_spools()
        deadline = time.monotonic() + wait_s
        while True:
            self._attempt_and_wait(max(1.0, deadline - time.monotonic()))
            with self._lock:
                left = self._unsent()
            if not left:
                try:
                    if status is not None:
                        self.client.set_terminated(self.run_id, status=status)
                    break
                except Exception as exc:
                    self._note_failure(exc)
            if time.monotonic() >= deadline:
                print(
                    f"[raytrain-lm] warning: tracking store {self.uri} still unreachable; "
                    f"{left} metrics/params/artifacts of run {self.run_id} not sent; metrics "
                    f"kept in {self._spool.parent}",
                    file=sys.stderr,
                    flush=True,
                )
                break
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        self._closed = True
        self._wake.set()

    # ------------------------------------------------------------------------------ internals

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
        kept = len(self._params) + len(self._tags) + len(self._inputs)
        return len(self._pending) + len(self._artifacts) + len(self._unless_stored) + kept

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

    def _send_all(self) -> None:
        sent, error = 0, None
        try:
            for kind in ("_params", "_tags", "_inputs"):
                with self._lock:
                    items = list(getattr(self, kind))
                if items:
                    self._log_batch(kind, items)
                    with self._lock:
                        del getattr(self, kind)[: len(items)]
            self._queue_missing()
            while True:
                with self._lock:
                    chunk = self._pending[:1000]
                if not chunk:
                    break
                try:
                    self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
                except Exception as exc:
                    if not _permanent(exc):
                        raise
                    print(f"[raytrain-lm] warning: dropped metrics MLflow refused: {exc}")
                with self._lock:
                    del self._pending[: len(chunk)]
                sent += len(chunk)
            while True:
                with self._lock:
                    if not self._artifacts:
                        break
                    path, artifact_path = self._artifacts[0]
                if Path(path).exists():
                    self.client.log_artifact(self.run_id, path, artifact_path)
                with self._lock:
                    self._artifacts.pop(0)
        except Exception as exc:
            error = exc
        if error is None:
            if self._down_since is not None:
                print(
                    f"[raytrain-lm] tracking store {self.uri} reachable again after "
                    f"{time.monotonic() - self._down_since:.0f} s; sent {sent} buffered metrics",
                    file=sys.stderr,
                    flush=True,
                )
                self._down_since = None
            self._spool.unlink(missing_ok=True)
        else:
            self._note_failure(error)
            self._write_spool()
        with self._attempted:
            self._attempts += 1
            self._attempted.notify_all()

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
            rows = [[m.key, m.value, m.timestamp, m.step] for m in self._pending]
        if not rows:
            return
        try:
            self._spool.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._spool.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(self._spool)
        except OSError:
            pass  # a full or read-only disk: the metrics still sit in memory

    def _adopt_spools(self) -> None:
        """Takes over metrics spooled by earlier processes of this run (a worker that ended
        while the store was down). Only the driver calls this, while no worker is logging."""
        from mlflow.entities import Metric

        folder = _spool_dir()
        if not folder.is_dir():
            return
        for file in sorted(folder.glob(f"{self.run_id}.*.jsonl")):
            if file == self._spool:
                continue
            try:
                rows = [json.loads(line) for line in file.read_text().splitlines() if line]
            except (OSError, ValueError):
                continue
            with self._lock:
                self._pending[:0] = [Metric(k, float(v), int(t), int(s)) for k, v, t, s in rows]
            file.unlink(missing_ok=True)
        if self._pending:
            self._write_spool()
