"""What a worker group writes to the run's event log (run_events/journal.py) as it trains: its
segment (one group's life, which goodput and cost are counted by), the chief's events of it that
the live goodput and the budget read, its heartbeats, and its throughput (tokens/s) as the
summary reports it."""

from __future__ import annotations

import time
import uuid
from typing import Any

from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import Heartbeat, HeartbeatWriter, append_event
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.components.pending_values import Throughput


class Journal:
    def __init__(self, run_dir: RunDir, t_start: float):
        self.run_dir, self.t_start = run_dir, t_start
        self.segment = uuid.uuid4().hex[:12]
        self.events: list[dict[str, Any]] = []  # the chief's, of this segment
        self.throughput = Throughput(first_step=0)
        self.heartbeats: HeartbeatWriter | None = None  # the chief's

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return append_event(self.run_dir, kind, **fields)

    def keep(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event the chief also keeps in `events`: what live goodput and the budget read."""
        record = self.event(kind, **fields)
        self.events.append(record)
        return record

    def restart_throughput(self, step: int) -> None:
        self.throughput = Throughput(first_step=step)

    def start_heartbeats(self) -> None:
        if self.heartbeats is None:
            self.heartbeats = HeartbeatWriter(self.run_dir)

    def heartbeat(self, step: int, unread_s: float) -> None:
        """The chief's heartbeat (step time is counted at reads; the time since the last one,
        `unread_s`, is step time too)."""
        self.start_heartbeats()
        self.heartbeats.put(self._beat(step, unread_s))

    def close(self, step: int, unread_s: float) -> None:
        if self.heartbeats is not None:
            self.heartbeats.close(self._beat(step, unread_s))

    def live_goodput(self, tokens: int, tokens_per_step: int) -> dict[str, float]:
        live = summarize(self.events, time.time())
        live.step_s += self.throughput.step_seconds
        return live.metrics(tokens, tokens_per_step)

    def _beat(self, step: int, unread_s: float) -> Heartbeat:
        seconds = self.throughput.step_seconds + unread_s
        return Heartbeat(self.segment, step, time.time(), seconds)
