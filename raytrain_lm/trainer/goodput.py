"""Goodput: how much of a run's wall time and money went into steps that count.

Everything is derived from an event log in the run directory (`events/`, one object per
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

Seconds lost to recovery: from the last progress of one group (or the start of the job that
resumed it) to the first step of the next. Steps recomputed: how far the previous group got
beyond the checkpoint the next one restored. Cost: each group's lifetime x its hourly price.
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


@dataclass
class Goodput:
    restarts: int = 0
    preemptions: int = 0
    recovery_s: float = 0.0
    steps_recomputed: int = 0
    step_s: float = 0.0  # time in optimizer steps, recomputed ones included
    recomputed_s: float = 0.0
    wall_s: float = 0.0  # worker groups' lifetimes plus recovery gaps
    cost: float = 0.0
    replica_incidents: int = 0  # replica groups lost or drained while the others went on
    replica_stall_s: float = 0.0  # the survivors' longest gap at each of them, summed
    full_strength_s: float = 0.0  # from each incident until as many groups took part again
    replica_joins: int = 0  # steps at which groups joined the others (healed from them)
    replica_join_stall_s: float = 0.0  # the others' longest gap at each of them, summed

    @property
    def productive_ratio(self) -> float:
        # Replica groups' stalls fall inside their steps' time, but trained nothing.
        stalled = self.recomputed_s + self.replica_stall_s + self.replica_join_stall_s
        return max(0.0, self.step_s - stalled) / self.wall_s if self.wall_s else 0.0

    def metrics(self, tokens: int, tokens_per_step: int = 0) -> dict[str, float]:
        out = {
            "goodput/restarts": self.restarts,
            "goodput/preemptions": self.preemptions,
            "goodput/recovery_s": self.recovery_s,
            "goodput/steps_recomputed": self.steps_recomputed,
            "goodput/tokens_recomputed": self.steps_recomputed * tokens_per_step,
            "goodput/productive_ratio": self.productive_ratio,
            "cost/total": self.cost,
        }
        if self.replica_incidents:
            out |= {
                "goodput/replica_incidents": self.replica_incidents,
                "goodput/replica_stall_s": self.replica_stall_s,
                "goodput/full_strength_s": self.full_strength_s,
            }
        if self.replica_joins:
            out |= {
                "goodput/replica_joins": self.replica_joins,
                "goodput/replica_join_stall_s": self.replica_join_stall_s,
            }
        if tokens:
            out["cost/per_million_tokens"] = self.cost / (tokens / 1e6)
        return out


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


def summarize(events: list[dict[str, Any]], now: float | None = None) -> Goodput:
    """Goodput over every worker group in `events`; an open last group counts up to `now`."""
    g = Goodput()
    segments: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    last_job_start: float | None = None
    previous_end: dict[str, Any] | None = None  # the last closed group's end
    prices: dict[str, list[dict[str, Any]]] = {}  # replica groups' price changes, by segment
    for e in events:
        kind = e["event"]
        if kind == "job_start":
            last_job_start = e["t"]
        elif kind == "preemption":
            g.preemptions += 1
        elif kind == "segment_start":
            seg = segments.setdefault(e["segment"], {})
            seg.update(start=e, job_start=last_job_start, previous_end=previous_end)
            order.append(e["segment"])
        elif kind == "first_step" and e["segment"] in segments:
            segments[e["segment"]]["first_step"] = e
        elif kind == "segment_end" and e["segment"] in segments:
            segments[e["segment"]]["end"] = e
            previous_end = e
        elif kind == "replica_price":
            prices.setdefault(e["segment"], []).append(e)
    for i, name in enumerate(order):
        seg = segments[name]
        start, end = seg["start"], seg.get("end")
        if i > 0:
            g.restarts += 1
        prev_end = seg["previous_end"]
        if prev_end is not None:
            recomputed = max(0, prev_end["step"] - start["restored_step"])
            g.steps_recomputed += recomputed
            prev_start = segments[prev_end["segment"]]["start"]
            prev_first = segments[prev_end["segment"]].get("first_step")
            prev_steps = prev_end["step"] - prev_start["restored_step"]
            if recomputed and prev_steps > 0:
                g.recomputed_s += prev_end["step_seconds"] * min(1.0, recomputed / prev_steps)
            if prev_first is not None:
                lost_from = prev_end["t"]
                if seg["job_start"] is not None and seg["job_start"] > lost_from:
                    lost_from = seg["job_start"]  # nothing ran between the two jobs
                resumed_at = seg.get("first_step", {}).get("t", now or start["t"])
                g.recovery_s += max(0.0, resumed_at - lost_from)
                g.wall_s += max(0.0, start["t_start"] - lost_from)
        until = end["t"] if end is not None else (now if now is not None else start["t"])
        lifetime = max(0.0, until - start["t_start"])
        g.wall_s += lifetime
        g.cost += _segment_cost(start, until, prices.get(name, []))
        if end is not None:
            g.step_s += end["step_seconds"]
    _replica_incidents(g, events, now)
    return g


def _segment_cost(start: dict[str, Any], until: float, changes: list[dict[str, Any]]) -> float:
    """A worker group's lifetime x its hourly price. Replica groups come and go within one
    segment: its chief records the price of the groups taking part whenever it changes
    (`replica_price`), the first from the segment's start (its groups started together)."""
    t, price = start["t_start"], start.get("price_per_hour", 0.0)
    if changes:
        price = changes[0]["price_per_hour"]
    usd = 0.0
    for change in changes[1:]:
        if change["t"] >= until:
            break
        usd += max(0.0, change["t"] - t) * price / 3600.0
        t, price = max(t, change["t"]), change["price_per_hour"]
    return usd + max(0.0, until - t) * price / 3600.0


def _replica_incidents(g: Goodput, events: list[dict[str, Any]], now: float | None) -> None:
    """Incidents of replica groups: each step at which fewer groups took part than before
    (every group records what it saw: one incident per step), its stall, and the time until
    as many took part as before it; and each step at which groups joined, with the stall of
    the groups that were there (the joiners' own gap is their start)."""
    changes: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "replicas_changed":
            changes.setdefault(e["step"], []).append(e)
    open_since: list[tuple[float, int]] = []  # (when, how many took part before)
    for step in sorted(changes):
        seen = changes[step]
        first = min(seen, key=lambda e: e["t"])
        if first["participants"] < first["previous"]:
            g.replica_incidents += 1
            g.replica_stall_s += max(e["gap_s"] for e in seen)
            open_since.append((first["t"], first["previous"]))
        elif first["participants"] > first["previous"]:
            stayed = [e["gap_s"] for e in seen if not e.get("joined")]
            g.replica_joins += 1
            g.replica_join_stall_s += max(stayed, default=0.0)
        restored = [(t, n) for t, n in open_since if first["participants"] >= n]
        for t, n in restored:
            g.full_strength_s += first["t"] - t
            open_since.remove((t, n))
    if now is not None:
        g.full_strength_s += sum(now - t for t, _ in open_since)
