"""Requests that end a worker group at a step boundary with a checkpoint: a spot notice (Ray
drains a node of ours) or the user's stop (`raytrain-lm stop`, SIGTERM, Ctrl-C).

The driver asks for a stop by writing a `STOP` file into the run directory; rank 0 looks for it,
and asks Ray whether a node is being drained, on its own clock (`fault.preemption_check_s`).
Its answer travels to every rank on the collective each step makes anyway, so all ranks take
the same just-in-time checkpoint at the same step. Why a group ended is then an event in the
run's log (`preemption` or `stop`), which the driver reads to decide what comes next.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow.fs as pafs

from raytrain_lm.rundir import STOP_FILE, RunDir
from raytrain_lm.storage import filesystem

PREEMPTION = "preemption"
STOP = "stop"
LIGHTHOUSE_LOST = "lighthouse_lost"  # replica groups ended for a new Lighthouse (a restart)
REPLICAS_DONE = "replicas_done"  # replica groups' chief: the groups ended this invocation
REPLICAS_TOO_FEW = "replicas_too_few"  # fewer than scaling.min_workers groups for too long


def request_stop(run_dir: RunDir, why: str) -> None:
    run_dir.write_text(json.dumps({"t": time.time(), "why": why}), STOP_FILE)


def clear_stop_request(run_dir: RunDir) -> None:
    run_dir.delete(STOP_FILE)


def stop_requested(run_dir: RunDir) -> bool:
    """Whether the driver asked for a stop; one look, no waiting: a bucket that does not
    answer now is asked again at the next check."""
    fs, inner = filesystem(run_dir.at(STOP_FILE))
    try:
        return fs.get_file_info(inner).type != pafs.FileType.NotFound
    except OSError:
        return False


def handoff_reason(events: list[dict[str, Any]]) -> str | None:
    """Why the newest worker group ended itself (`preemption`, `stop`, or replica groups'
    `lighthouse_lost` or `replicas_too_few`), or None if it did not: it trained to the end of
    this invocation, or failed."""
    reason = None
    for event in events:
        if event["event"] == "segment_start":
            reason = None
        elif event["event"] in (PREEMPTION, STOP, LIGHTHOUSE_LOST, REPLICAS_TOO_FEW):
            reason = event["event"]
    return reason


def last_stop(events: list[dict[str, Any]]) -> dict[str, Any]:
    stops = [e for e in events if e["event"] == STOP]
    return stops[-1] if stops else {}


def stop_why(events: list[dict[str, Any]]) -> str:
    """Why the newest stop was raised: "request" (the user's), "budget" (budget.max_usd) or
    "capacity" (scaling.capacity=spot_first moves the run; the stop names the `market`)."""
    return last_stop(events).get("why", "request")
