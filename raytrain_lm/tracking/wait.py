"""Waiting for a tracking store that does not answer, before a run starts.

A run cannot start without its MLflow run id, so `MLflowTracker.start` waits for the store,
up to `tracking.start_wait_s` (a sweep's trial or a restart during an outage), and keeps the
user told: a warning when the wait begins, then a one-line status every so often (how long it
waited, how long is left, how to stop or to go on without tracking), and a line when the
store answers. Ctrl-C meanwhile raises `InterruptedBeforeStart`: nothing of the run started or
was written, which is what the CLI then says.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

from raytrain_lm.errors import InterruptedBeforeStart, UserError

Opened = TypeVar("Opened")

RETRY_EVERY_S = 5.0
# The first status soon after the warning, so a user knows the run is alive; then sparser.
FIRST_STATUS_S = 10.0
STATUS_EVERY_S = 30.0


def _say(text: str) -> None:
    print(f"[raytrain-lm] {text}", file=sys.stderr, flush=True)


def open_when_reachable(
    open_run: Callable[[], Opened],
    uri: str,
    run_name: str,
    wait_s: float,
    permanent: Callable[[Exception], bool],
) -> Opened:
    """`open_run()`'s result, retried while it fails with an error that is not `permanent`,
    up to `wait_s`; then a `UserError` naming the store and `tracking.start_wait_s`."""
    began = time.monotonic()
    deadline = began + wait_s
    next_status = began + FIRST_STATUS_S
    waiting = False
    try:
        while True:
            try:
                opened = open_run()
                break
            except Exception as exc:
                if permanent(exc):
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise UserError(
                        f"tracking store {uri} unreachable: could not open run '{run_name}' "
                        f"within {wait_s:g} s (tracking.start_wait_s); start the store, point "
                        f"tracking.uri elsewhere or set tracking.enabled=false "
                        f"({type(exc).__name__})"
                    ) from exc
                if not waiting:
                    _say(
                        f"warning: tracking store {uri} unreachable ({type(exc).__name__}); "
                        f"waiting up to {wait_s:.0f} s to open run '{run_name}' "
                        "(tracking.start_wait_s)"
                    )
                    waiting = True
                elif now >= next_status:
                    _say(
                        f"still waiting for tracking store {uri}: {now - began:.0f} s waited, "
                        f"{deadline - now:.0f} s left; Ctrl-C stops, tracking.enabled=false "
                        "runs without tracking"
                    )
                    next_status = now + STATUS_EVERY_S
                time.sleep(max(0.0, min(RETRY_EVERY_S, deadline - now, next_status - now)))
    except KeyboardInterrupt:
        raise InterruptedBeforeStart(
            f"interrupted while waiting for tracking store {uri}: '{run_name}' did not start "
            "and nothing of it was written; start the store (or set tracking.enabled=false) "
            "and run the command again"
        ) from None
    if waiting:
        _say(f"tracking store {uri} reachable again after {time.monotonic() - began:.0f} s")
    return opened
