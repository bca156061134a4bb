"""`MLflowTracker`: the handle of one MLflow run, held by the driver and rank 0: opening the
run (waiting for its store if need be), logging to it without ever waiting on the store
(buffered_sender.py), ending it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from raytrain_lm.redaction import redact
from raytrain_lm.tracking.buffered_sender import BufferedSender
from raytrain_lm.tracking.models import CheckpointModel
from raytrain_lm.tracking.runs import open_run
from raytrain_lm.tracking.store import (
    check_local_store,
    is_permanent,
    refusal,
    retry_on_our_schedule,
)
from raytrain_lm.tracking.wait import open_when_reachable


class MLflowTracker(BufferedSender):
    """Buffers per-step metrics and writes them in batches so logging never stalls a step."""

    def __init__(self, uri: str, run_id: str, flush_every: int = 50, flush_wait_s: float = 10.0):
        from mlflow.tracking import MlflowClient

        retry_on_our_schedule(uri)
        super().__init__(MlflowClient(tracking_uri=uri), uri, run_id)
        self._flush_every = flush_every
        self._flush_wait_s = flush_wait_s

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
        creates a new MLflow run, nested under `parent_run_id` when given (runs.py).

        A run cannot start without its run id, so while the store is unreachable this waits
        for it, up to `wait_s` (a sweep's trial or a restart during an outage), saying so
        (wait.py), then raises a `UserError` naming the store and `tracking.start_wait_s`."""
        retry_on_our_schedule(uri)
        check_local_store(uri)
        try:
            opened = open_when_reachable(
                lambda: open_run(uri, experiment, run_name, run_id, parent_run_id),
                uri,
                run_name,
                wait_s,
                lambda exc: is_permanent(exc) or refusal(exc, uri, experiment) is not None,
            )
        except Exception as exc:
            refused = refusal(exc, uri, experiment)
            if refused is None:
                raise
            raise refused from None
        tracker = cls(uri, opened)
        if tags:
            tracker.set_tags(tags)
        tracker._adopt_spools()
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

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Uploads now, or keeps the file's path and uploads when the store is back."""
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as exc:
            if is_permanent(exc):
                raise
            self._note_failure(exc)
            with self._lock:
                self._artifacts.append((str(path), artifact_path))
            self._ensure_thread()

    def log_checkpoint(self, model: CheckpointModel) -> None:
        """Logs a complete checkpoint as a model of the run (models.py), from the background
        thread: the caller (an upload) never waits on the store."""
        with self._lock:
            self._models.append(model)
        self._ensure_thread()
        self._wake.set()

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
        (trainer/groups/quorum.py's ChiefTracker)."""
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
        deadline = time.monotonic() + self._flush_wait_s
        while True:
            self._attempt_and_wait(max(0.1, deadline - time.monotonic()))
            with self._lock:
                # An attempt already under way when something was queued (a checkpoint's
                # model, right before a worker ends) did not take it: one more does.
                settled = not self._unsent() or self._down_since is not None
            if settled or time.monotonic() >= deadline:
                return

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
