"""Fault injection for chaos tests: real failures at precise points, each fired once.

`RAYTRAIN_LM_FAULT` in the driver's environment travels to the workers in their spec:

- `kill-in-checkpoint:step=4:rank=0`: that worker kills its own process (SIGKILL: no cleanup,
  like a lost machine) half-way through writing that step's checkpoint. A marker in the run
  directory keeps the fault from firing again after the restart it causes.
- `kill-after-checkpoint:step=6:rank=0`: the same, just after that step's checkpoint was
  reported and uploaded whole (that report waits for its upload), before the next step.
- `slow-steps:seconds=0.05`: every step takes at least that long, so a test's node changes
  happen mid-run however fast the machine is. Once the run directory holds `PACE_OFF` (the
  test has seen the changes it waited for; see `stop_pacing`) the rest of the run goes at
  full speed: each worker looks for it about once a second, within a long step too (a
  pace of many minutes holds a run at its first step until the test releases it).
- `device-time:seconds=0.003:rank=1:factor=3`: a simulated device. Every rank's forward pass
  takes `seconds` longer per sequence and its backward twice that (the host sleeps, as it
  waits for a GPU); the named rank's take `factor` times as long, as a slower GPU type beside
  faster ones (scaling.balance's test and benchmark). Unlike the real work on these shared
  CPU cores, the simulated time does not change with the machine's load.

- `kill-while-healing:step=20:rank=1`: a replica group (scaling.fault_tolerance=replicas)
  kills its own process while it loads the state a peer sent it, the first time that state
  is at `step` or later (once per group; any group without `rank`).

- `kill-in-round:step=12:rank=1`: under `parallel.sync=diloco`, that replica group kills its
  own process just after that inner step, between two outer syncs (once). A group training
  alone waits for the first such step in a round shared with another group: a slow start of
  the others would otherwise make the death one nobody sees at a sync.

- `kill-chief-after-read`: the replica groups' chief kills its own process just after it
  logged a read of the pending steps (its tracker then holds metrics it has not sent), at its
  first read after the test armed it (`arm_chief_kill`), once; armed with a checkpoint
  interval, at its first read at a checkpoint step: before it writes the ledger and the
  checkpoint that the step's read precedes.

Several at once are joined with `+`: `slow-steps:seconds=0.1+kill-while-healing`.

And one diagnostic, which changes nothing:

- `count-syncs`: each worker counts the host's reads of device values made by our code at
  step, and on CUDA every synchronization torch makes (see SyncCounter), apart from those of
  the steps that log, evaluate or checkpoint; rank 0 records both in the run's events
  (`host_syncs`). The hot path must count 0 at every step: it never waits for the device.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from raytrain_lm.rundir import RunDir

ENV_VAR = "RAYTRAIN_LM_FAULT"
PACE_OFF = "fault-pace-off"
PACE_OFF_CHECK_S = 1.0


@dataclass(frozen=True)
class Fault:
    point: str
    step: int | None = None
    rank: int | None = None
    seconds: float = 0.0
    factor: float = 1.0  # device-time: how much slower the named rank is


class Faults(tuple):
    """Several faults at once: `slow-steps:seconds=0.1+kill-while-healing:rank=1`."""


def find(fault: Fault | Faults | None, point: str) -> Fault | None:
    """The fault at `point` among those given, if any."""
    for one in fault if isinstance(fault, Faults) else (fault,):
        if one is not None and one.point == point:
            return one
    return None


def parse(spec: str | None) -> Fault | Faults | None:
    if not spec:
        return None
    if "+" in spec:
        return Faults(parse(part) for part in spec.split("+"))
    point, *rest = spec.split(":")
    fields = dict(part.split("=", 1) for part in rest)
    return Fault(
        point,
        step=int(fields["step"]) if "step" in fields else None,
        rank=int(fields["rank"]) if "rank" in fields else None,
        seconds=float(fields.get("seconds", 0.0)),
        factor=float(fields.get("factor", 1.0)),
    )


def from_environment() -> Fault | None:
    return parse(os.environ.get(ENV_VAR))


def targets(fault: Fault | Faults | None, point: str, step: int) -> bool:
    """Whether `fault` fires at `point` of `step` (on some rank)."""
    fault = find(fault, point)
    return fault is not None and fault.step in (None, step)


def maybe_fire(
    fault: Fault | Faults | None,
    point: str,
    step: int | None,
    rank: int,
    run_dir: RunDir,
    from_step_on: bool = False,
) -> None:
    """Kills this process at `point` of `step` on `rank`, once per run. `from_step_on`: at the
    first call at or after the fault's step (the caller decides when it is eligible)."""
    fault = find(fault, point)
    if fault is None or fault.rank not in (None, rank):
        return
    late = from_step_on and step is not None and fault.step is not None and step > fault.step
    if fault.step not in (None, step) and not late:
        return
    marker = f"fault-fired-{point}-{fault.step if from_step_on else step}-{rank}"
    if run_dir.exists(marker):
        return
    run_dir.write_text("fired\n", marker)
    os.kill(os.getpid(), signal.SIGKILL)


CHIEF_KILL_ARMED = "fault-kill-chief-armed"


def arm_chief_kill(run_dir: RunDir | str | Path, at_multiple_of: int = 1) -> None:
    """Fires `kill-chief-after-read` at the chief's next read at a step that is a multiple
    of `at_multiple_of` (1: its next read)."""
    RunDir.coerce(run_dir).write_text(f"{at_multiple_of}\n", CHIEF_KILL_ARMED)


def maybe_kill_chief(fault: Fault | Faults | None, run_dir: RunDir, step: int) -> None:
    """`kill-chief-after-read`, where the chief has just logged a read of `step` (once armed)."""
    if find(fault, "kill-chief-after-read") is None:
        return
    armed = run_dir.read_text(CHIEF_KILL_ARMED)
    if armed is not None and step % int(armed) == 0:
        maybe_fire(fault, "kill-chief-after-read", None, 0, run_dir)


class Pacer:
    """`slow-steps` for one worker: sleeps out the rest of each step's minimum length until
    the run directory says to stop (ranks that disagree for a second only wait for each
    other, as any rank's pace is the group's)."""

    def __init__(self, fault: Fault | None, run_dir: RunDir):
        fault = find(fault, "slow-steps")
        self.seconds = fault.seconds if fault is not None else 0.0
        self.run_dir = run_dir
        self._next_check = 0.0

    def pace(self, step_started: float) -> None:
        if not self.seconds:
            return
        now = time.perf_counter()
        if now >= self._next_check:
            self._next_check = now + PACE_OFF_CHECK_S
            if self.run_dir.exists(PACE_OFF):
                self.seconds = 0.0
                return
        remaining = self.seconds - (now - step_started)
        # A pace longer than a check holds the step only until the run says to stop pacing:
        # a test can hold a run at a step for as long as it needs, then release it.
        while remaining > PACE_OFF_CHECK_S:
            time.sleep(PACE_OFF_CHECK_S)
            remaining -= PACE_OFF_CHECK_S
            if self.run_dir.exists(PACE_OFF):
                self.seconds = 0.0
                return
        time.sleep(max(0.0, remaining))


def stop_pacing(run_dir: RunDir | str | Path) -> None:
    """Tells a `slow-steps` run's workers to go at full speed from now on."""
    RunDir.coerce(run_dir).write_text("off\n", PACE_OFF)


def simulate_device(model, fault: Fault | None, rank: int) -> None:
    """With `device-time`, makes `model`'s forward, and the backward of its loss, take the
    simulated device's time per sequence on this rank."""
    fault = find(fault, "device-time")
    if fault is None:
        return
    import torch

    per_sequence = fault.seconds * (fault.factor if fault.rank == rank else 1.0)

    def after_forward(module, args, output):
        forward_s = per_sequence * args[0].shape[0]  # args[0]: token ids (B, T)
        time.sleep(forward_s)
        loss = output[1] if isinstance(output, tuple) else None
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(lambda grad: time.sleep(2 * forward_s))

    model.register_forward_hook(after_forward)


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode's


class SyncCounter:
    """Counts the host's waits for the device, in two ways.

    - Our code's reads of tensor values (`item`, `tolist`, `float(t)`, `int(t)`, `bool(t)`):
      only calls made from raytrain_lm's own modules, not those inside PyTorch (a CPU
      optimizer reads its step counter, a fused GPU one does not).
    - On CUDA, every synchronization torch itself makes (`torch.cuda.set_sync_debug_mode`:
      stream synchronizations, device-to-host copies, `nonzero`, ...), wherever it comes
      from, which the first cannot see; our reads are among them.
    """

    METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
    armed = True

    def __init__(self, device=None) -> None:
        import torch

        self.per_step: dict[int, int] = {}  # step -> reads by the step and its cadence checks
        self.at_reads: dict[int, int] = {}  # step -> reads by its logging, eval, checkpoint
        self.device_per_step: dict[int, int] = {}  # the same for torch's synchronizations
        self.device_at_reads: dict[int, int] = {}
        self._count = 0
        self._device_count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(original))
        self.counts_device = device is not None and device.type == "cuda"
        if self.counts_device:
            self._watch_device_syncs(torch)

    def _counting(self, original):
        import sys

        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("raytrain_lm."):
                self._count += 1
            return original(tensor, *args, **kwargs)

        return read

    def _watch_device_syncs(self, torch) -> None:
        """torch warns at every synchronization from here on; the warnings are counted and
        not shown (any other warning is shown as before)."""
        import warnings

        warnings.filterwarnings("always", message=SYNC_WARNING)  # not once per source line
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self._device_count += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def close_step(self, step: int) -> None:
        """The waits since the last close were made by `step`'s own work."""
        self.per_step[step], self.device_per_step[step] = self._take()

    def reset(self) -> None:
        self._take()

    def close_read(self, step: int) -> None:
        """The waits since the last close were made by `step`'s read of the pending steps
        and what followed it (expected: that is where values are read)."""
        self.at_reads[step], self.device_at_reads[step] = self._take()

    def _take(self) -> tuple[int, int]:
        counts = self._count, self._device_count
        self._count = self._device_count = 0
        return counts

    def summary(self) -> dict[str, dict[int, int]]:
        """What a run records (`host_syncs` event): torch's counts only where it made them."""
        found = {"per_step": self.per_step, "at_reads": self.at_reads}
        if self.counts_device:
            found |= {
                "device_per_step": self.device_per_step,
                "device_at_reads": self.device_at_reads,
            }
        return found


class NoSyncCounter:
    """Without `count-syncs`: the loop's calls count nothing."""

    armed = False

    def close_step(self, step: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def close_read(self, step: int) -> None:
        pass


def sync_counter(fault: Fault | None, device=None) -> SyncCounter | NoSyncCounter:
    """With `count-syncs`, a counter installed in this process (a worker on `device`)."""
    if find(fault, "count-syncs") is None:
        return NoSyncCounter()
    return SyncCounter(device)
