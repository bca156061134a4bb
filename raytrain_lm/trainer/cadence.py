"""When the loop's periodic work happens: every N steps, every S seconds, and at the end.

The loop declares its cadences in one table (log, eval, checkpoint, signal check, heartbeat)
instead of testing counters inline, so when each thing happens can be read in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Every:
    """Due every `steps` optimizer steps, every `seconds` of wall time (by this process's
    clock), and/or at the last step of the invocation."""

    steps: int | None = None
    seconds: float | None = None
    at_end: bool = False
    _last_time: float = field(default_factory=time.monotonic, repr=False)

    def due(self, step: int, end_step: int) -> bool:
        if self.at_end and step == end_step:
            return True
        if self.steps is not None and step % self.steps == 0:
            return True
        if self.seconds is not None and time.monotonic() - self._last_time >= self.seconds:
            self._last_time = time.monotonic()
            return True
        return False
