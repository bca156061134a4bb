"""Rounds and spot notices: a group whose node is being drained says so at a sync, leaves after
that unit's duties, and the others plan the next unit without it, so that no unit is lost to
a group everyone knew would go."""

from __future__ import annotations

from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.groups.replicas import ReplicaGroup


class Leavers:
    def __init__(self, group: ReplicaGroup):
        self.group = group
        self.leaves_after_round = False  # this group said at the sync that it leaves
        self.quorum_stale = False  # groups left since the last quorum

    def drained(self, parts: LoopParts) -> bool:
        """Whether this group's node is being drained (a spot notice), asked on the cadence of
        `fault.preemption_check_s` (one request to Ray's control plane)."""
        if not parts.every.signals.due(parts.progress.step, parts.end_step):
            return False
        ray = self.group.ray
        return ray.draining_deadline_ms(ray.node_id()) is not None

    def plan_without(self, leavers: list[float]) -> None:
        """After a committed unit, the groups that announced a spot notice leave (after its
        duties) and the others plan the next unit without them: their places in the quorum
        close up, so the next sync, which the leavers miss, finds every position taken. A
        leaver is chief no more (the next chief writes the unit's checkpoint). When every
        group leaves, nobody replans: the chief checkpoints as the last group would."""
        members = self.group.members
        leaving = [i for i in range(members.participants) if leavers[i] > 0]
        if not leaving or members.participant is None:
            return
        if len(leaving) == members.participants:  # the chief ends the run as the last does
            self.leaves_after_round = True
            if members.is_chief:
                members.participants = 1
            else:
                members.participant = None
            return
        if members.participant in leaving:
            self.leaves_after_round, members.participant = True, None
            return
        staying = [i for i in range(members.participants) if i not in leaving]
        self.quorum_stale = True
        members.participant, members.participants = staying.index(members.participant), len(staying)
