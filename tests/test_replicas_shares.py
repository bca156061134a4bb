"""The arithmetic of exactly-once with replica groups (trainer/replicas.py), without Ray:
whoever takes part in a step, its positions are taken once; and what replicas refuses."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_lm.config import TrainingConfig, load_config
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.plan import BatchPlan
from raytrain_lm.trainer.replicas import check_step_taken, position_checksum

GLOBAL_BATCH = 12


@pytest.mark.parametrize("participants", [1, 2, 3, 4, 5])
def test_any_number_of_participants_takes_each_position_once(participants):
    """However many groups take part, their slices of step s are [s*G, (s+1)*G) exactly, and
    the loss weights P*b/G averaged over the P participants sum to one; a participant that
    sliced with another count than the others is caught by the checksum."""
    training = TrainingConfig(global_batch_size=GLOBAL_BATCH)
    plan = BatchPlan.derive(training, participants, [1.0] * participants)
    step = 7
    positions = np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    slices = [
        positions[plan.offset(p) : plan.offset(p) + plan.shares[p]] for p in range(participants)
    ]
    assert np.array_equal(np.concatenate(slices), positions)
    weights = [participants * len(s) / GLOBAL_BATCH for s in slices]
    assert sum(weights) / participants == pytest.approx(1.0)
    summed = np.sum([position_checksum(s) for s in slices], axis=0).tolist()
    check_step_taken(step, GLOBAL_BATCH, summed)
    if participants > 1:  # one participant still believes in one more
        stale = BatchPlan.derive(training, participants + 1, [1.0] * (participants + 1))
        last = participants - 1  # its slice by the stale plan
        wrong = [
            *slices[:-1],
            positions[stale.offset(last) : stale.offset(last) + stale.shares[last]],
        ]
        with pytest.raises(RuntimeError, match="took positions"):
            check_step_taken(
                step, GLOBAL_BATCH, np.sum([position_checksum(s) for s in wrong], axis=0).tolist()
            )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "use parallel.strategy=ddp"),
        (["scaling.balance=auto"], "give weights by type"),
        (["scaling.num_workers=4", "training.global_batch_size=3"], "fewer than one sequence"),
    ],
)
def test_replicas_refuses_what_it_cannot_do(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["scaling.fault_tolerance=replicas", *overrides])


def test_goodput_counts_each_replica_incident_once():
    """Every group records the change it saw; goodput counts one incident per step, with the
    survivors' longest gap, and the time until as many groups took part again."""
    from raytrain_lm.trainer.goodput import summarize

    def change(t, step, group, now, before, gap):
        return {"event": "replicas_changed", "t": t, "step": step, "group": group,
                "participants": now, "previous": before, "gap_s": gap}  # fmt: skip

    events = [
        change(10.0, 16, 0, 1, 2, 2.1),  # group 1 lost: one incident, seen by the survivor
        change(30.0, 110, 0, 2, 1, 2.5),  # its replacement back: full strength after 20 s
        change(30.1, 110, 1, 2, 1, 2.4),
        change(31.0, 111, 0, 1, 2, 2.0),  # drained: open until `now`
    ]
    g = summarize(events, now=41.0)
    assert g.replica_incidents == 2
    assert g.replica_stall_s == pytest.approx(4.1)
    assert g.full_strength_s == pytest.approx(20.0 + 10.0)
    assert g.metrics(tokens=0)["goodput/replica_incidents"] == 2
