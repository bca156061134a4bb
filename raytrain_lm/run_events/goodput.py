"""Goodput: how much of a run's wall time and money went into steps that count, derived from
its event journal (journal.py).

Seconds lost to recovery: from the last progress of one group (or the start of the job that
resumed it) to the first step of the next. Steps recomputed: how far the previous group got
beyond the checkpoint the next one restored. Cost: each group's lifetime x its hourly price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def summarize(events: list[dict[str, Any]], now: float | None = None) -> Goodput:
    """Goodput over every worker group in `events`; an open last group counts up to `now`."""
    g = Goodput(preemptions=sum(e["event"] == "preemption" for e in events))
    segments, order, prices = _segments(events)
    for i, name in enumerate(order):
        seg = segments[name]
        if i > 0:
            g.restarts += 1
        if seg["previous_end"] is not None:
            _charge_recovery(g, seg, segments, now)
        start, end = seg["start"], seg.get("end")
        until = end["t"] if end is not None else (now if now is not None else start["t"])
        g.wall_s += max(0.0, until - start["t_start"])
        g.cost += _segment_cost(start, until, prices.get(name, []))
        if end is not None:
            g.step_s += end["step_seconds"]
    _replica_incidents(g, events, now)
    return g


def _segments(
    events: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, list[dict[str, Any]]]]:
    """Each worker group's events by segment (with the job start before it and the end of the
    group before it), the segments in the order they started, and replica groups' price
    changes by segment."""
    segments: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    prices: dict[str, list[dict[str, Any]]] = {}
    last_job_start: float | None = None
    previous_end: dict[str, Any] | None = None  # the last closed group's end
    for e in events:
        kind = e["event"]
        if kind == "job_start":
            last_job_start = e["t"]
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
    return segments, order, prices


def _charge_recovery(
    g: Goodput, seg: dict[str, Any], segments: dict[str, dict[str, Any]], now: float | None
) -> None:
    """What the group before `seg` lost: the steps it took past the checkpoint `seg` restored,
    and the time from its last progress to `seg`'s first step."""
    start, prev_end = seg["start"], seg["previous_end"]
    recomputed = max(0, prev_end["step"] - start["restored_step"])
    g.steps_recomputed += recomputed
    prev_start = segments[prev_end["segment"]]["start"]
    prev_first = segments[prev_end["segment"]].get("first_step")
    prev_steps = prev_end["step"] - prev_start["restored_step"]
    if recomputed and prev_steps > 0:
        g.recomputed_s += prev_end["step_seconds"] * min(1.0, recomputed / prev_steps)
    if prev_first is None:
        return
    lost_from = prev_end["t"]
    if seg["job_start"] is not None and seg["job_start"] > lost_from:
        lost_from = seg["job_start"]  # nothing ran between the two jobs
    resumed_at = seg.get("first_step", {}).get("t", now or start["t"])
    g.recovery_s += max(0.0, resumed_at - lost_from)
    g.wall_s += max(0.0, start["t_start"] - lost_from)


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
