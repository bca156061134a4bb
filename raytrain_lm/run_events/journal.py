"""A run's event journal: an event log in the run directory (`events/`, one object per
event, so that writers on different nodes never touch the same object and a bucket needs no
append) plus a heartbeat that rank 0 overwrites as it steps. Events survive the processes
that wrote them, so a restarted worker group (or a restarted driver) can account for what the
previous one lost:

- `job_start` (driver): a `raytrain-lm train` invocation began.
- `failure_detected` (Ray Train controller callback): workers failed; recovery starts.
- `segment_start` (rank 0): a worker group started, restored `restored_step`, runs
  `world_size` workers costing `price_per_hour` together; with the times the training
  function started (`t_start`) and finished restoring (`t_restored`).
- `first_step` (rank 0): the group's first optimizer step finished.
- `preemption` (rank 0): a node was being drained; a just-in-time checkpoint was written.
- `segment_end` (rank 0 of the next group, from the heartbeat): how far a group got.
- `replicas_changed` (each replica group, `scaling.fault_tolerance=replicas`): the number of
  groups taking part changed at `step`; `gap_s` since the group's previous committed step is
  the survivors' stall (`joined`: the group itself joined at that step).
- `replica_price` (the replica groups' chief): what the groups taking part cost together
  per hour, from `t` on (each group's `fault.price_per_hour`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_lm.rundir import EVENTS_DIR, HEARTBEAT_FILE, LEGACY_EVENTS_FILE, RunDir


def append_event(run_dir: RunDir | str | Path, event: str, **fields: Any) -> dict[str, Any]:
    record = {"event": event, "t": fields.pop("t", time.time()), **fields}
    run_dir = RunDir.coerce(run_dir)
    run_dir.write_text(json.dumps(record), EVENTS_DIR, run_dir.new_object_name(".json"))
    return record


def read_events(run_dir: RunDir | str | Path) -> list[dict[str, Any]]:
    """Every event, in the order written (object names sort by their writer's clock)."""
    run_dir = RunDir.coerce(run_dir)
    events = []
    legacy = run_dir.read_text(LEGACY_EVENTS_FILE)
    for line in (legacy or "").splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a crash
            events.append(json.loads(line))
    for name in run_dir.list_files(EVENTS_DIR):
        text = run_dir.read_text(EVENTS_DIR, name)
        if text is not None:  # None: pruned between listing and reading
            with contextlib.suppress(ValueError):
                events.append(json.loads(text))
    return events


@dataclass
class Heartbeat:
    segment: str
    step: int
    t: float
    step_seconds: float  # time spent in optimizer steps by this group so far

    def write(self, run_dir: RunDir | str | Path) -> None:
        # One writer (rank 0), replaced whole: readers never see half a heartbeat.
        RunDir.coerce(run_dir).write_text(json.dumps(asdict(self)), HEARTBEAT_FILE)

    @classmethod
    def read(cls, run_dir: RunDir | str | Path) -> Heartbeat | None:
        try:
            return cls(**json.loads(RunDir.coerce(run_dir).read_text(HEARTBEAT_FILE) or ""))
        except (OSError, ValueError, TypeError):
            return None


class HeartbeatWriter:
    """Writes rank 0's heartbeats from a thread of its own: a bucket PUT takes tens of
    milliseconds, which no step should wait for. Only the newest unwritten beat is kept."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._pending: Heartbeat | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def put(self, beat: Heartbeat) -> None:
        with self._wake:
            self._pending = beat
            self._wake.notify()

    def close(self, last: Heartbeat | None = None) -> None:
        """Writes `last` (or what is pending) before returning."""
        with self._wake:
            if last is not None:
                self._pending = last
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                beat, self._pending = self._pending, None
                closed = self._closed
            if beat is not None:
                try:
                    beat.write(self.run_dir)
                except OSError as exc:  # the bucket is away: the next beat tries again
                    print(f"[raytrain-lm] heartbeat not written: {exc}", file=sys.__stdout__)
            if closed and self._pending is None:
                return


def close_previous_segment(run_dir: RunDir | str | Path) -> None:
    """Records how far the previous worker group got (its heartbeat) as its `segment_end`."""
    beat = Heartbeat.read(run_dir)
    if beat is None:
        return
    events = read_events(run_dir)
    if any(e["event"] == "segment_end" and e.get("segment") == beat.segment for e in events):
        return
    append_event(
        run_dir,
        "segment_end",
        t=beat.t,
        segment=beat.segment,
        step=beat.step,
        step_seconds=beat.step_seconds,
    )
