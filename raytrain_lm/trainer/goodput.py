"""Goodput: how much of a run's wall time and money went into steps that count.

Everything is derived from an append-only event log in the run directory (`events.jsonl`)
plus a heartbeat file that rank 0 overwrites as it steps. Events survive the processes that
wrote them, so a restarted worker group (or a restarted driver) can account for what the
previous one lost:

- `job_start` (driver): a `raytrain-lm train` invocation began.
- `failure_detected` (Ray Train controller callback): workers failed; recovery starts.
- `segment_start` (rank 0): a worker group started, restored `restored_step`, runs
  `world_size` workers costing `price_per_hour` together; with the times the training
  function started (`t_start`) and finished restoring (`t_restored`).
- `first_step` (rank 0): the group's first optimizer step finished.
- `preemption` (rank 0): a node was being drained; a just-in-time checkpoint was written.
- `segment_end` (rank 0 of the next group, from the heartbeat): how far a group got.

Seconds lost to recovery: from the last progress of one group (or the start of the job that
resumed it) to the first step of the next. Steps recomputed: how far the previous group got
beyond the checkpoint the next one restored. Cost: each group's lifetime x its hourly price.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_lm.rundir import EVENTS_FILE, HEARTBEAT_FILE


def append_event(run_dir: str | Path, event: str, **fields: Any) -> dict[str, Any]:
    record = {"event": event, "t": fields.pop("t", time.time()), **fields}
    path = Path(run_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:  # one short write: lines stay whole
        out.write(json.dumps(record) + "\n")
    return record


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    return events


@dataclass
class Heartbeat:
    segment: str
    step: int
    t: float
    step_seconds: float  # time spent in optimizer steps by this group so far

    def write(self, run_dir: str | Path) -> None:
        path = Path(run_dir) / HEARTBEAT_FILE
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)  # readers never see half a heartbeat

    @classmethod
    def read(cls, run_dir: str | Path) -> Heartbeat | None:
        try:
            return cls(**json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


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

    @property
    def productive_ratio(self) -> float:
        return max(0.0, self.step_s - self.recomputed_s) / self.wall_s if self.wall_s else 0.0

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
        if tokens:
            out["cost/per_million_tokens"] = self.cost / (tokens / 1e6)
        return out


def close_previous_segment(run_dir: str | Path) -> None:
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
        g.cost += lifetime * start.get("price_per_hour", 0.0) / 3600.0
        if end is not None:
            g.step_s += end["step_seconds"]
    return g
