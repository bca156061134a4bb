"""`parallel.sync=local_sgd` (trainer/syncs/local_sgd.py): the groups' weights averaged at each
round's end through torchft's LocalSGD, in the same rounds as DiLoCo (syncs/rounds.py). It is
DiLoCo with an outer SGD of learning rate 1 and no momentum, and trains the same steps; a group
killed in the middle of a round loses no sequence and repeats none."""

from __future__ import annotations

import pytest
from support.replica_kill import train_until_group_1_replaced
from support.step_losses import step_losses

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.runtime import ensure_ray
from raytrain_lm.trainer import chaos

H = 4


def test_local_sgd_trains_what_diloco_with_a_plain_outer_step_trains(
    world_size_runs, plain_diloco_run
):
    """Two groups, H=4, the world-size runs' 12 steps (3 rounds): LocalSGD's step losses
    within 1e-6 of DiLoCo's with outer lr 1 and no momentum (start weights minus the mean
    change are the mean weights; the session's `plain_diloco_run`), every position once, and
    one sync of the weights a round."""
    common, steps = world_size_runs["common"], world_size_runs["reference"]["steps"]
    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    two = [
        *common,
        "scaling.fault_tolerance=replicas",
        "scaling.num_workers=2",
        f"diloco.sync_every={H}",
    ]
    diloco = plain_diloco_run["summary"]
    local = raytrain_lm.train(
        load_config(None, [*two, "parallel.sync=local_sgd", "name=local-sgd"]), sample=False
    )
    assert local["steps"] == diloco["steps"] == steps == 3 * H and not local["stopped"]
    ours, reference = (
        step_losses(uri, local["mlflow_run_id"]),
        step_losses(uri, diloco["mlflow_run_id"]),
    )
    assert sorted(ours) == sorted(reference) == list(range(1, steps + 1))
    gap = max(abs(ours[s] - reference[s]) for s in ours)
    assert gap < 1e-6, gap
    assert local["val_loss"] == pytest.approx(diloco["val_loss"], abs=1e-6)
    run_dir = world_size_runs["output_dir"] / "local-sgd"
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))
    events = read_events(run_dir)
    assert not [e for e in events if e["event"] == "round_retaken"]


@pytest.mark.beside
def test_a_local_sgd_group_killed_mid_round_loses_no_sequence(
    tiny_overrides, tmp_path, monkeypatch
):
    """Two groups, H=4, 240 steps paced at 0.3 s until the replacement started: group 1 kills
    its own process after its eleventh step, in the middle of the third round (steps 9-12).
    Group 0's sync at step 12 finds it gone: the round does not commit, group 0 puts back the
    weights of step 8 and takes the round again alone. Ray Train replaces group 1, which heals
    from group 0 and joins at a round's end. The run completes, every position exactly once,
    group 0 in one process."""
    run_dir = tmp_path / "runs" / "local-killed"
    overrides = [
        *tiny_overrides,
        "name=local-killed",
        "scaling.fault_tolerance=replicas",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
        "parallel.sync=local_sgd",
        f"diloco.sync_every={H}",
        "training.global_batch_size=12",
        "training.max_steps=240",
        "training.ledger=true",
        "training.eval_every=100000",
        "checkpoint.every_steps=80",
        "fault.max_failures=-1",
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.3+kill-in-round:step=11:rank=1")
    # Ray started here, not in the run's thread (see test_diloco's kill test).
    ensure_ray(load_config(None, overrides).scaling)
    summary = train_until_group_1_replaced(run_dir, overrides)

    assert summary["steps"] == 240 and not summary["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(240 * 12))
    events = read_events(run_dir)
    starts = [e for e in events if e["event"] == "replica_start"]
    assert len({e["pid"] for e in starts if e["group"] == 0}) == 1, "the survivor restarted"
    assert [e["healed"] for e in starts if e["group"] == 1][-1], "the replacement healed"
    retaken = [e for e in events if e["event"] == "round_retaken"]
    assert retaken and all(e["step"] % H == 0 and e["step"] >= 8 for e in retaken), retaken
    assert all(e["group"] == 0 for e in retaken), retaken
    assert list(run_dir.glob("fault-fired-kill-in-round-11-1")), "group 1 was not killed"
