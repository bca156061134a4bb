"""`parallel.sync=diloco` (trainer/syncs/diloco.py) on the session's Ray, with no incident:
DiLoCo that syncs every step with a plain outer step is every-step sync; with H=4, rounds of 4
steps, every position once, duties at round ends, and a quarter of the bytes per token;
Streaming DiLoCo's commit units; and a Streaming DiLoCo group killed between two fragment syncs."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow
import pytest
from support.in_process import here_spec, train_here
from support.replica_kill import train_until_group_1_replaced
from support.step_losses import assert_same_step_losses

import raytrain_lm
from raytrain_lm.checkpoints import complete_checkpoints, read_state
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.runtime import ensure_ray
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.groups.membership import Membership
from raytrain_lm.trainer.syncs.diloco_parts import model_fragments, unit_schedule
from raytrain_lm.trainer.syncs.leavers import Leavers

H = 4


def _metric(uri: str, run_id: str, name: str) -> list[tuple[int, float]]:
    history = mlflow.tracking.MlflowClient(tracking_uri=uri).get_metric_history(run_id, name)
    return sorted((m.step, m.value) for m in history)


def test_diloco_h1_is_every_step_sync_and_h4_sends_a_quarter_of_the_bytes(
    world_size_runs, plain_diloco_run
):
    """One group: DiLoCo with H=1, outer lr 1 and no momentum takes every-step sync's steps
    (the outer step puts the round's start weights onto the inner step's: step losses within
    1e-5). With more groups the two differ by design: averaging the groups' AdamW updates is
    not AdamW on their averaged gradients. Two groups with H=4 (the session's
    `plain_diloco_run`; the outer optimizer changes none of what follows): 3 rounds of 4 steps,
    each position once, checkpoints at the first round end past each multiple of 3, and the
    bytes each group hands to its all-reduces per token a quarter of every-step sync's (the
    round's per-step losses and checksums ride along: 0.13 % of this tiny model's 34k
    parameters)."""
    common, steps = world_size_runs["common"], world_size_runs["reference"]["steps"]
    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    one = [*common, "scaling.fault_tolerance=replicas", "scaling.num_workers=1"]
    every = raytrain_lm.train(load_config(None, [*one, "name=every-step-1"]), sample=False)
    plain = ["parallel.sync=diloco", "diloco.sync_every=1", "diloco.outer_lr=1"]
    h1 = raytrain_lm.train(
        load_config(None, [*one, *plain, "diloco.outer_momentum=0", "name=diloco-h1"]),
        sample=False,
    )
    assert_same_step_losses(uri, h1["mlflow_run_id"], every["mlflow_run_id"], steps)

    h4, run_dir = plain_diloco_run["summary"], plain_diloco_run["run_dir"]
    assert h4["steps"] == steps and not h4["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))
    outer = _metric(uri, h4["mlflow_run_id"], "diloco/outer_step")
    assert [value for _, value in outer] == [(s - 1) // H + 1 for s in range(1, steps + 1)]
    events = read_events(run_dir)
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert saved == [4, 8, 12], saved  # every 3 steps: at the first round end past each
    assert read_state(complete_checkpoints(run_dir)[-1]).step == steps
    assert not [e for e in events if e["event"] == "round_retaken"]

    def bytes_per_token(summary) -> float:
        return _metric(uri, summary["mlflow_run_id"], "comm/bytes_per_token")[-1][1]

    ratio = bytes_per_token(every) / bytes_per_token(h4)
    assert H * 0.995 <= ratio <= H, ratio
    sent = _metric(uri, h4["mlflow_run_id"], "comm/bytes_sent")[-1][1]
    per_sync = _metric(uri, h4["mlflow_run_id"], "comm/bytes_per_outer_step")[-1][1]
    assert per_sync == pytest.approx(sent / 3, rel=1e-3)  # 3 syncs of the weights


def test_streaming_diloco_commits_at_full_syncs_and_sends_what_diloco_sends(world_size_runs):
    """Streaming DiLoCo: two groups, H=4, 2 fragments, a sync of both every 2 rounds. The
    12 steps are a unit of 8 (fragment 0 synced alone after step 2, fragment 1 after step 4,
    both at step 8) and one of 4 (both at its end): every position once, the run's duties at
    the two unit ends only, and the same bytes as DiLoCo with H=4 (each fragment synced once
    per 4 steps: three whole models' worth), which a run without the single-fragment syncs
    would undercut by a third."""
    common, steps = world_size_runs["common"], world_size_runs["reference"]["steps"]
    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    two = [*common, "scaling.fault_tolerance=replicas", "scaling.num_workers=2"]
    diloco = ["parallel.sync=diloco", f"diloco.sync_every={H}", "diloco.outer_lr=1"]
    streaming = ["diloco.fragments=2", "diloco.full_sync_every=2", "name=h4-streaming"]
    summary = raytrain_lm.train(load_config(None, [*two, *diloco, *streaming]), sample=False)
    assert summary["steps"] == steps and not summary["stopped"]
    run_dir = world_size_runs["output_dir"] / "h4-streaming"
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))
    outer = _metric(uri, summary["mlflow_run_id"], "diloco/outer_step")
    assert [value for _, value in outer] == [1] * 8 + [2] * 4
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [8, 12]
    assert not [e for e in events if e["event"] == "round_retaken"]
    sent = _metric(uri, summary["mlflow_run_id"], "comm/bytes_sent")[-1][1]
    per_sync = _metric(uri, summary["mlflow_run_id"], "comm/bytes_per_outer_step")[-1][1]
    assert per_sync == pytest.approx(sent / 3, rel=1e-3)  # 3 models' worth
    cfg = load_config(None, common)
    weights = 4 * sum(p.numel() for p in build_model(cfg.model, 257).parameters())  # fp32
    assert 3 * weights < sent < 3.01 * weights, sent / weights  # and the losses, checksums
    assert summary["val_loss"] < 5.0  # ln(257) = 5.55 at the start


def test_two_groups_syncing_every_8_steps_learn_within_5_percent_of_ddp(world_size_runs):
    """The learnable corpus (Python's docs), 240 steps of 12 sequences: 2 groups with H=8 and
    plain outer averaging (outer lr 1, no momentum) against 2-worker every-step DDP at the same
    tokens. Measured: val loss 2.879 against 2.795, a 3.0 % gap. With the paper's outer
    Nesterov (0.7, 0.9), made for H in the hundreds and long runs, this short run ends 7.8 %
    behind at H=32 (docs/diloco.md has the table). DDP's steps are trained by the loop in this
    process (tests/support/in_process.py: one worker takes two DDP workers' steps, within 1e-5
    a step), which spares a Ray Train run."""
    common = [
        *world_size_runs["common"],
        "training.max_steps=240",
        "training.eval_every=240",
        "training.eval_sequences=128",
        "training.ledger=false",
        "checkpoint.every_steps=100000",
        "tracking.enabled=false",
        "scaling.num_workers=2",
    ]
    kept, _ = train_here(here_spec([*common, "name=ddp-240", "scaling.num_workers=1"]))
    ddp = {"steps": max(kept.steps), "val_loss": kept.steps[max(kept.steps)]["val/loss"]}
    diloco = [
        "scaling.fault_tolerance=replicas",
        "parallel.sync=diloco",
        "diloco.sync_every=8",
        "diloco.outer_lr=1",
        "diloco.outer_momentum=0",
        "name=diloco-h8-240",
    ]
    h8 = raytrain_lm.train(load_config(None, [*common, *diloco]), sample=False)
    gap = h8["val_loss"] / ddp["val_loss"] - 1
    print(f"val loss: DDP {ddp['val_loss']:.4f}, DiLoCo H=8 {h8['val_loss']:.4f}, gap {gap:.2%}")
    assert h8["steps"] == ddp["steps"] == 240
    assert ddp["val_loss"] < 3.2  # it learned: ln(257) = 5.55 at the start (measured 2.79)
    assert gap < 0.05, gap


@pytest.mark.beside
def test_a_group_killed_between_syncs_loses_no_sequence_and_the_survivor_goes_on(
    tiny_overrides, tmp_path, monkeypatch
):
    """Streaming DiLoCo (H=4, 2 fragments, a sync of both every 8 steps), two groups, 240 steps
    paced at 0.3 s until the replacement joined (so that it comes well before the end however
    slowly it starts): group 1 kills its own process after its eleventh inner step, in the
    middle of the second unit (steps 9-16), after fragment 0 synced at step 10. Group 0's sync
    of fragment 1 at step 12 finds it gone: the unit is lost; at its end group 0 forms a quorum
    alone, every group votes not to commit, and group 0 puts back the weights and outer
    optimizers of step 8 and takes the unit alone. Ray Train replaces group 1, which heals
    from group 0 at a unit's end and commits group 0's unit with it (it sends zero
    pseudo-gradients; the average is over the group that trained), then takes its share. The
    run completes, every position exactly once, group 0 in one process. (Plain DiLoCo's kill is
    the CLI's node-kill test in test_jobs.py.)"""
    run_dir = tmp_path / "runs" / "killed"
    overrides = [
        *tiny_overrides,
        "name=killed",
        "scaling.fault_tolerance=replicas",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
        "parallel.sync=diloco",
        "diloco.sync_every=4",
        "diloco.fragments=2",
        "diloco.full_sync_every=2",
        "training.global_batch_size=12",
        "training.max_steps=240",
        "training.ledger=true",
        "training.eval_every=100000",
        "checkpoint.every_steps=80",
        "fault.max_failures=-1",
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.3+kill-in-round:step=11:rank=1")
    # Ray started here, not in the run's thread: the processes a local Ray starts are killed
    # when the thread that started them ends (PR_SET_PDEATHSIG), and later tests use that Ray.
    ensure_ray(load_config(None, overrides).scaling)
    summary = train_until_group_1_replaced(run_dir, overrides)

    assert summary["steps"] == 240 and not summary["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(240 * 12))
    events = read_events(run_dir)
    starts = [e for e in events if e["event"] == "replica_start"]
    assert len({e["pid"] for e in starts if e["group"] == 0}) == 1, "the survivor restarted"
    healed = [e["healed"] for e in starts if e["group"] == 1]
    assert len(healed) == 2 and healed[-1], healed  # the replacement healed from group 0
    retaken = [e for e in events if e["event"] == "round_retaken"]
    assert retaken and all(e["step"] % 8 == 0 and e["step"] >= 8 for e in retaken)
    assert all(e["group"] == 0 for e in retaken), retaken  # the join retakes nothing
    assert list(run_dir.glob("fault-fired-kill-in-round-11-1")), "group 1 was not killed"


def _planned(participant: int, participants: int, leavers: list[float]) -> tuple:
    """A group's place after a committed unit whose sums said who leaves (syncs/leavers.py)."""
    members = Membership(participant, 3)
    members.participant, members.participants = participant, participants
    plan = Leavers(SimpleNamespace(members=members))
    plan.plan_without(leavers)
    return members.participant, members.participants, plan.leaves_after_round


def test_groups_close_up_around_a_drained_one_and_the_chief_ends_an_all_drained_run():
    """Three groups, the second announced a spot notice: it leaves (chief no more), the others
    take places 0 and 1 of two. Every group drained: the chief plans to be the last group (it
    checkpoints and the run restarts elsewhere), the others leave. Nobody drained: nothing
    changes."""
    assert [_planned(p, 3, [0.0, 1.0, 0.0]) for p in range(3)] == [
        (0, 2, False),
        (None, 3, True),
        (1, 2, False),
    ]
    assert [_planned(p, 2, [1.0, 1.0, 0.0]) for p in range(2)] == [
        (0, 1, True),
        (None, 2, True),
    ]
    assert _planned(1, 2, [0.0, 0.0]) == (1, 2, False)


def test_streaming_units_sync_each_fragment_once_per_round_and_fragments_balance():
    """A unit of 2 rounds (H=4, 2 fragments) syncs fragment 0 after 2 steps and fragment 1
    after 4, then both at its end; a unit of one round syncs nothing inside; a short last unit
    only what leaves a round after it. Fragments are contiguous runs of the model's tensors,
    every parameter in exactly one, of about equal size; more fragments than tensors are
    refused."""
    assert unit_schedule(8, 4, 2) == {2: [0], 4: [1]}
    assert unit_schedule(4, 4, 2) == {}
    assert unit_schedule(10, 4, 2) == {2: [0], 4: [1], 6: [0]}
    assert unit_schedule(16, 8, 4) == {2: [0], 4: [1], 6: [2], 8: [3]}
    cfg = load_config(None, ["model.n_layer=4"])
    model = build_model(cfg.model, 257)
    fragments = model_fragments(model, 3)
    ids = [id(p) for f in fragments for p in f.parameters()]
    assert ids == [id(p) for p in model.parameters()]  # the same tensors, in order, once
    sizes = [sum(p.numel() for p in f.parameters()) for f in fragments]
    assert max(sizes) < 1.6 * min(sizes), sizes
    with pytest.raises(UserError, match="more than the model's"):
        model_fragments(model, 1000)
