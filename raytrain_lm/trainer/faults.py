"""Fault injection for chaos tests: real failures at precise points, each fired once.

`RAYTRAIN_LM_FAULT` in the driver's environment travels to the workers with the run's payload:

- `kill-in-checkpoint:step=4:rank=0`: that worker kills its own process (SIGKILL: no cleanup,
  like a lost machine) half-way through writing that step's checkpoint. A marker in the run
  directory keeps the fault from firing again after the restart it causes.
- `kill-after-checkpoint:step=6:rank=0`: the same, just after that step's checkpoint was
  reported (complete and on disk), before the next step.
- `slow-steps:seconds=0.05`: every step takes at least that long, so a test's node changes
  happen mid-run however fast the machine is.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV_VAR = "RAYTRAIN_LM_FAULT"


def parse(spec: str | None) -> dict[str, str] | None:
    if not spec:
        return None
    point, *rest = spec.split(":")
    fields = dict(part.split("=", 1) for part in rest)
    return {"point": point, **fields}


def maybe_fire(
    fault: dict[str, str] | None, point: str, step: int, rank: int, run_dir: str
) -> None:
    if not fault or fault["point"] != point:
        return
    if int(fault.get("step", step)) != step or int(fault.get("rank", rank)) != rank:
        return
    marker = Path(run_dir) / f"fault-fired-{point}-{step}-{rank}"
    if marker.exists():
        return
    marker.write_text("fired\n")
    os.kill(os.getpid(), signal.SIGKILL)


def pace(fault: dict[str, str] | None, step_started: float) -> None:
    if fault and fault["point"] == "slow-steps":
        time.sleep(max(0.0, float(fault["seconds"]) - (time.perf_counter() - step_started)))
