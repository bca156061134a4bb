"""Stopping a run on request, at a step boundary with a checkpoint, from the driver.

The first SIGTERM (`raytrain-lm stop`, `ray job stop`, a scheduler) or Ctrl-C asks the workers
to stop (components/stop_requests.py): they take a just-in-time checkpoint at the next step boundary and end;
the run is then resumable from exactly there. A second signal, or `fault.stop_timeout_s`
without the checkpoint, ends the driver at once (a KeyboardInterrupt), losing the steps since
the last checkpoint, as a kill would.

Ray Train's `fit()` installs its own Ctrl-C handler (abort the run, no checkpoint) when called
from the main thread, so the driver runs it in a thread of its own (`run_interruptibly`) and
keeps the main thread's signal handlers.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.components.stop_requests import clear_stop_request, request_stop

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Printed when a stop request reached the driver; `raytrain-lm stop` looks for it in a job's
# log to tell a second stop (force it) from a first.
STOP_ACKNOWLEDGED = "stopping at the next step with a checkpoint"


class GracefulStop:
    """Context manager: while inside, SIGINT/SIGTERM request a graceful stop (main thread
    only; elsewhere, e.g. in a sweep's trial, it does nothing)."""

    def __init__(self, run_dir: RunDir, timeout_s: float):
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> GracefulStop:
        clear_stop_request(self.run_dir)  # a request left by an earlier, killed driver
        if threading.current_thread() is threading.main_thread():
            for number in _SIGNALS:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if self._timer is not None:
            self._timer.cancel()
        clear_stop_request(self.run_dir)

    def _on_signal(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.requested:
            print(
                f"[raytrain-lm] {name} again: ending now, without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            raise KeyboardInterrupt
        self.requested = True
        request_stop(self.run_dir, why=name)
        print(
            f"[raytrain-lm] {name}: {STOP_ACKNOWLEDGED} (at most "
            f"{self.timeout_s:g} s, fault.stop_timeout_s); send it again to end at once",
            file=sys.stderr,
            flush=True,
        )
        self._timer = threading.Timer(self.timeout_s, self._time_out)
        self._timer.daemon = True
        self._timer.start()

    def _time_out(self) -> None:
        print(
            f"[raytrain-lm] no checkpoint within fault.stop_timeout_s ({self.timeout_s:g} s); "
            "ending now",
            file=sys.stderr,
            flush=True,
        )
        _thread.interrupt_main(signal.SIGINT)  # a second signal, from ourselves


def run_interruptibly(fn: Callable[[], Any]) -> Any:
    """`fn()` in a thread of its own, the main thread waiting on it: signals reach the main
    thread's handlers between waits, and `fn` cannot install its own."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    thread = threading.Thread(target=call, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")
