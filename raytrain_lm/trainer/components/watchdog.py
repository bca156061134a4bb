"""A step-progress watchdog: a worker that finishes no step for too long exits.

A worker blocked in a collective on a dead peer can wait for the process-group timeout; the
watchdog bounds that wait whatever the cause (a hung collective, a stuck read, a deadlock),
dumps every thread's stack for the post-mortem, and exits so Ray Train restarts the group.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time


class StepWatchdog:
    def __init__(self, timeout_s: float, what: str = "step"):
        self.timeout_s = timeout_s
        self.what = what
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(
                    f"[raytrain-lm] watchdog: no {self.what} finished for {idle:.0f} s "
                    f"(fault.step_timeout_s={self.timeout_s:g}); exiting this worker so the "
                    "run restarts. Stacks follow.",
                    file=sys.__stderr__,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
                os._exit(70)
