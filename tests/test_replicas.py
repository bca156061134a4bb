"""Replica groups (`scaling.fault_tolerance=replicas`, trainer/groups/replicas.py) on a local
multi-node Ray: nodes killed, added and drained, a group killed while it heals, the Lighthouse
lost, too few groups; every sequence once, and every committed step's loss equal to an
uninterrupted run's (the arithmetic of exactly-once: test_replicas_shares.py)."""

from __future__ import annotations

import os
import time

import pytest
from support.step_losses import assert_same_step_losses

import raytrain_lm
from raytrain_lm.checkpoints import latest_complete_checkpoint, read_state
from raytrain_lm.clusters.multinode import Background, LocalCluster, wait_for_event
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer import chaos

pytestmark = pytest.mark.chaos

GLOBAL_BATCH, STEPS, CHECKPOINT_EVERY = 12, 240, 40


# ----------------------------------------------------------------------------- on a cluster


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RUST_LOG", "warn")  # before the nodes start: the Lighthouse's log
    local = LocalCluster(workers=2)
    yield local
    local.shutdown()


@pytest.fixture
def replica_overrides(cluster, tiny_overrides):
    while len(cluster.nodes) < 2:  # a test that killed a node leaves one fewer
        cluster.add_node()
    while len(cluster.nodes) > 2:  # the drill's third
        cluster.kill_node()
    return [
        *tiny_overrides,
        *cluster.overrides(),
        "scaling.fault_tolerance=replicas",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
        f"training.global_batch_size={GLOBAL_BATCH}",
        f"training.max_steps={STEPS}",
        "training.ledger=true",
        "training.precision=fp32",
        "training.eval_every=100000",
        f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "data.shuffle_window_shards=1",
        "fault.max_failures=-1",
    ]


def _events(run_dir, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == kind]


def _stepping_together(groups: int):
    """Whether `groups` groups committed a step together (a busy machine may take seconds to
    heal the later ones at the start): before that, losing one changes no step's participants."""

    def matches(event: dict) -> bool:
        if event["event"] == "replica_start":  # all in the first quorum: nobody healed
            return event["participants"] == groups and not event["healed"]
        return event["event"] == "replicas_changed" and event["participants"] == groups

    return matches


_both_groups_stepped = _stepping_together(2)


def _taking_part(participants: int, after: float):
    return lambda e: (
        e["event"] == "replicas_changed" and e["participants"] == participants and e["t"] > after
    )


def _node_of(cluster: LocalCluster, run_dir, group: int):
    """The node the newest process of replica group `group` runs on."""
    started = [e for e in _events(run_dir, "replica_start") if e["group"] == group]
    (node,) = [n for n in cluster.nodes if n.node_id == started[-1]["node"]]
    return node


DRILL_STEPS = 880  # a multiple of CHECKPOINT_EVERY; paced until the drill's last incident; the rest at full speed


def test_groups_train_on_through_loss_join_heal_kill_and_drain(
    cluster, replica_overrides, tmp_path, monkeypatch
):
    """The chaos drill of issue 44 on three groups, one per node.
    1. A node with a group is killed: the others never stop; the lost group is replaced once
       capacity comes back and heals from a survivor (weights and optimizer state bit for bit),
       even when the first replacement is killed while healing.
    2. A spot notice drains a node: its group leaves at a step boundary, nothing recomputed,
       no checkpoint; the cloud then takes the node, and no capacity is left for its group,
       which waits for it (`replica_held`) instead of blocking Ray Train's controller.
    3. Meanwhile the chief dies right after logging a read (its tracker holds unsent metrics)
       at a checkpoint step, before it writes that step's ledger and checkpoint: its group is
       replaced on its own node's free slot, and the group that becomes chief logs what the
       dead one had not stored and writes the ledger from the dead one's last file on.
    4. Meanwhile a node comes back: the waiting group is replaced there.
    Every sequence once, every step logged once, losses equal to an uninterrupted run's; the
    groups that were there lose little when a group joins (goodput counts it)."""
    cluster.add_node()
    overrides = [*replica_overrides, "scaling.max_workers=3", f"training.max_steps={DRILL_STEPS}"]
    reference = raytrain_lm.train(load_config(None, [*overrides, "name=steady"]), sample=False)
    run_dir = tmp_path / "runs" / "chaos"
    overrides = [*overrides, "name=chaos"]
    # The first heal after step 20 (the lost group 2's replacement) is cut short by killing
    # it: the replacement of the replacement heals. Paced so that the incidents, however slowly a
    # busy machine starts nodes and workers, come long before the last step.
    monkeypatch.setenv(
        chaos.ENV_VAR,
        "slow-steps:seconds=0.4+kill-while-healing:step=20:rank=2+kill-chief-after-read",
    )
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    wait_for_event(run_dir, _stepping_together(3), 300, still_running=run)

    # 1. a node lost, then capacity back
    killed_at = time.time()
    cluster.kill_node(_node_of(cluster, run_dir, 2))  # the chief is group 0: not it yet
    shrunk = wait_for_event(run_dir, _taking_part(2, killed_at), 120, still_running=run)
    cluster.add_node()
    grown = wait_for_event(run_dir, _taking_part(3, shrunk["t"]), 300, still_running=run)

    # 2. a spot notice; at its deadline the node is gone and no capacity is left
    drained_at = time.time()
    drained = cluster.drain_node(_node_of(cluster, run_dir, 1), deadline_s=10)
    left = wait_for_event(
        run_dir, lambda e: e["event"] == "replica_drained", 60, after=drained_at, still_running=run
    )
    time.sleep(max(0.0, drained_at + 10 - time.time()))  # the cloud's deadline, not a race
    cluster.kill_node(drained)
    held = wait_for_event(
        run_dir, lambda e: e["event"] == "replica_held", 120, after=drained_at, still_running=run
    )

    # 3. the chief dies between two flushes of its metrics, at a checkpoint step before its
    # ledger and checkpoint; its slot is free on a live node
    chaos.arm_chief_kill(run_dir, at_multiple_of=CHECKPOINT_EVERY)
    lost_chief = wait_for_event(run_dir, _taking_part(1, held["t"]), 120, still_running=run)

    # 4. meanwhile capacity comes back for the group that waited: both are replaced
    cluster.add_node()
    released = wait_for_event(
        run_dir, lambda e: e["event"] == "replica_released", 600, after=lost_chief["t"],
        still_running=run,
    )  # fmt: skip
    regrown = wait_for_event(run_dir, _taking_part(3, released["t"]), 600, still_running=run)
    chaos.stop_pacing(run_dir)
    summary = run.wait(600)

    assert summary["steps"] == DRILL_STEPS and not summary["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(DRILL_STEPS * GLOBAL_BATCH))
    starts = _events(run_dir, "replica_start")
    # Groups 0 and 1 survive the first loss in their processes (until the drain and the
    # chief's death end them on purpose).
    survivors = {e["pid"] for e in starts if e["group"] != 2 and e["t"] < drained_at}
    assert len(survivors) == 2, "a survivor of the first loss restarted"
    assert grown["step"] > shrunk["step"] and left["step"] >= grown["step"]
    assert held["group"] == left["group"] == 1
    assert regrown["step"] > lost_chief["step"]
    assert lost_chief["group"] == 2  # group 0 was the chief: group 2 spoke for the run after
    replaced = [e for e in starts if e["t"] > lost_chief["t"] and e["healed"]]
    assert {e["group"] for e in replaced} == {0, 1}, "the chief's and the drained group's"
    # Healing: what the joiner loaded is what the peer sent, bit for bit.
    sent = {e["step"]: e for e in _events(run_dir, "replica_sent")}
    healed = [e for e in starts if e["healed"]]
    assert healed and all(
        (e["params_sha"], e["optim_sha"])
        == (sent[e["step"]]["params_sha"], sent[e["step"]]["optim_sha"])
        for e in healed
    )
    assert list(tmp_path.glob("runs/chaos/fault-fired-kill-while-healing-*")), "no heal was cut"
    assert list(tmp_path.glob("runs/chaos/fault-fired-kill-chief-after-read-*"))
    # No restart, nothing recomputed, no checkpoint at the drained step.
    goodput = summary["goodput"]
    assert goodput["restarts"] == 0 and goodput["steps_recomputed"] == 0
    assert 0.2 < goodput["productive_ratio"] <= 1  # one segment, whoever was chief
    incidents = goodput["replica_incidents"]
    assert incidents >= 3 and 0 < goodput["replica_stall_s"] < 10 * incidents  # restart: 17-36 s
    # Joins: the groups already there wait for the joiner's first step only (it started its
    # data stream before joining); goodput counts each join's stall.
    joins = goodput["replica_joins"]
    assert joins >= 3 and 0 < goodput["replica_join_stall_s"] < 10 * joins
    # Periodic checkpoints only (one may fall on the drained step), none for the drain.
    steps = [int(c.name.split("_")[1]) for c in run_dir.glob("checkpoint_*")]
    assert steps and all(step % CHECKPOINT_EVERY == 0 for step in steps), steps
    # The same steps as the run that saw none of it, each logged once, the dead chief's too.
    uri = next(o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri="))
    assert_same_step_losses(uri, summary["mlflow_run_id"], reference["mlflow_run_id"], DRILL_STEPS)


def _wait_for_checkpoint_after(run_dir, step: int, run: Background, timeout: float = 300) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        latest = latest_complete_checkpoint(run_dir)
        reached = read_state(latest).step if latest is not None else -1
        if reached > step:
            return reached
        assert run.running, f"the run ended before a checkpoint after step {step}"
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint after step {step} within {timeout:.0f} s")


def test_lighthouse_lost_then_every_group_lost_restart_from_checkpoints(
    cluster, replica_overrides, tmp_path, monkeypatch
):
    """The torchft Lighthouse dies (its process killed): no quorum can form again, so the
    chief checkpoints at once and the driver starts the run again with a new Lighthouse, from
    exactly that step. Then every group is lost at once: the groups started again restore the
    newest periodic checkpoint, as a restart-mode run does (when Ray Train's controller fails
    while it replaces them, as it may on a loaded machine, the driver starts the run again
    from that checkpoint). Every sequence once."""
    from ray.util.state import list_actors

    run_dir = tmp_path / "runs" / "lost"
    overrides = [*replica_overrides, "name=lost"]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.1")
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    wait_for_event(run_dir, _both_groups_stepped, 300, still_running=run)
    (lighthouse,) = list_actors(
        filters=[("class_name", "=", "LighthouseServerActor"), ("state", "=", "ALIVE")]
    )
    os.kill(lighthouse.pid, 9)  # the head stays: only the Lighthouse's process goes
    lost = wait_for_event(
        run_dir, lambda e: e["event"] == "lighthouse_lost", 120, still_running=run
    )
    resumed = wait_for_event(
        run_dir,
        lambda e: e["event"] == "segment_start" and e["t"] > lost["t"],
        300,
        still_running=run,
    )
    assert resumed["restored_step"] == lost["step"]  # the just-in-time checkpoint
    newest = _wait_for_checkpoint_after(run_dir, lost["step"], run)  # a periodic one
    killed_at = time.time()
    cluster.kill_node()
    cluster.kill_node()
    chaos.stop_pacing(run_dir)  # no group is left to pace: the restored ones go at full speed
    cluster.add_node()
    cluster.add_node()
    restored = wait_for_event(
        run_dir,
        lambda e: e["event"] == "segment_start",
        300,
        after=killed_at,
        still_running=run,
    )
    summary = run.wait(600)
    assert summary["steps"] == STEPS
    assert restored["restored_step"] >= newest > lost["step"]  # a periodic one, not the first
    assert read_ledger(run_dir).tolist() == list(range(STEPS * GLOBAL_BATCH))


def test_too_few_groups_wait_then_say_why(cluster, replica_overrides, tmp_path, monkeypatch):
    """min_workers groups are needed and one is lost with no capacity to replace it: the
    survivor waits replicas.min_workers_wait_s, then the run ends with a one-line reason, its
    ledger exact up to its newest checkpoint."""
    overrides = [
        *replica_overrides,
        "name=few",
        "scaling.min_workers=2",
        "replicas.min_workers_wait_s=10",
    ]
    run_dir = tmp_path / "runs" / "few"
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.1")
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    _wait_for_checkpoint_after(run_dir, 0, run)
    killed_at = time.time()
    cluster.kill_node()
    with pytest.raises(UserError) as failed:
        run.wait(300)
    message = str(failed.value)
    assert "no quorum of scaling.min_workers=2 replica groups for" in message
    assert "\n" not in message and "lower scaling.min_workers" in message
    (gave_up,) = _events(run_dir, "replicas_too_few")
    assert gave_up["t"] - killed_at >= 10  # replicas.min_workers_wait_s
    assert f"stopped at step {gave_up['step']}" in message
    latest = read_state(latest_complete_checkpoint(run_dir)).step
    assert 0 < latest <= gave_up["step"]
    assert read_ledger(run_dir).tolist() == list(range(latest * GLOBAL_BATCH))


def test_diloco_plans_a_drained_group_out_of_the_next_round(
    cluster, replica_overrides, tmp_path, monkeypatch
):
    """`parallel.sync=diloco`, H=4: a spot notice drains a node. Its group says so at the next
    sync, whose round commits with it; it leaves after that round and the other group plans the
    next rounds alone, so no round is taken again and nothing is recomputed. Every sequence
    once, the survivor in one process."""
    run_dir = tmp_path / "runs" / "diloco-drain"
    steps = 160
    overrides = [
        *replica_overrides,
        "name=diloco-drain",
        "parallel.sync=diloco",
        "diloco.sync_every=4",
        f"training.max_steps={steps}",
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.3")
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    wait_for_event(run_dir, _both_groups_stepped, 300, still_running=run)
    drained = cluster.drain_node(deadline_s=120)
    try:
        left = wait_for_event(
            run_dir, lambda e: e["event"] == "replica_drained", 60, still_running=run
        )
        chaos.stop_pacing(run_dir)
        summary = run.wait(600)
    finally:  # the cloud takes the machine at its deadline; the next tests need its slot
        cluster.kill_node(drained)

    assert summary["steps"] == steps and not summary["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(steps * GLOBAL_BATCH))
    assert left["step"] % 4 == 0, left  # at a round's end
    assert not _events(run_dir, "round_retaken"), "the drained group's round was taken again"
    shrunk = [e for e in _events(run_dir, "replicas_changed") if e["participants"] == 1]
    assert [e["step"] for e in shrunk] == [left["step"] + 4], shrunk  # the next round, alone
    starts = _events(run_dir, "replica_start")
    stayed = {e["group"] for e in starts} - {left["group"]}
    assert len({e["pid"] for e in starts if e["group"] in stayed}) == 1, "the survivor restarted"
