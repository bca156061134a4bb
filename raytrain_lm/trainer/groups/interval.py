"""`checkpoint.every_steps=auto` across replica groups. The chief chooses the next interval
after its checkpoint (checkpointing/writer.py: its save and step times, the run's
interruptions), but every group must read at the same checkpoint steps, so that whoever is
chief next holds exactly what the last one did not write (replicas.py). The choice therefore
travels in the next step's sums, and every participant puts it in use as that step commits; a
group that joins takes the interval in use from the peer it heals from (healing.py)."""

from __future__ import annotations

from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.checkpointing.checkpoint_interval import observed_interruptions
from raytrain_lm.trainer.components.cadence import Every

SLOTS = 3  # proposals, steps, since + 1: summed over the participants


class IntervalAgreement:
    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.proposed: tuple[int, int] | None = None  # (steps, since): sent until committed
        # The run's interruptions so far (rate per second, recovery seconds): the first chief
        # read them as it started (groups/start.py), a successor reads them as it first chooses.
        self.known_interruptions: tuple[float, float] | None = None

    def interruptions(self) -> tuple[float, float]:
        if self.known_interruptions is None:
            self.known_interruptions = observed_interruptions(self.run_dir)
        return self.known_interruptions

    def propose(self, steps: int, since: int) -> None:
        self.proposed = (steps, since)

    def sums(self) -> list[float]:
        if self.proposed is None:
            return [0.0] * SLOTS
        steps, since = self.proposed
        return [1.0, float(steps), float(since + 1)]

    def settle(self, summed: list[float], cadence: Every) -> None:
        """A committed step's proposal, in use from now on; two at once (two chiefs, each
        thinking itself the one) would be a sum of both: none is taken, and the next
        checkpoint chooses again."""
        proposals, steps, since = (round(value) for value in summed)
        if proposals == 1:
            cadence.count_every(steps, since - 1)
        if proposals:
            self.proposed = None
