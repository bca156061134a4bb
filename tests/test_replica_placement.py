"""ReplaceWhenPlaceable (trainer/driver/replica_placement.py) decides from Ray Train's poll what the
controller may act on: checked here against Ray Train 2.60's own poll and status types, with
a stand-in for the worker group and for the cluster's state; the drill in test_replicas.py
runs it on a real cluster. And the Ray Train internals it uses are still there."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer.driver.replica_placement import ClusterView, ReplaceWhenPlaceable

pytestmark = pytest.mark.no_ray


def test_ray_train_still_has_what_the_callback_uses():
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    from ray.train.v2._internal.execution.worker_group.execution_group import ReplicaGroup
    from ray.train.v2._internal.execution.worker_group.worker import Worker
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    hooks = ("after_worker_group_start", "before_worker_group_shutdown",
             "before_worker_group_abort", "after_worker_group_poll_status")  # fmt: skip
    assert all(callable(getattr(WorkerGroupCallback, h, None)) for h in hooks)
    poll_fields = {f.name for f in dataclasses.fields(WorkerGroupPollStatus)}
    assert {"worker_statuses", "worker_rank_to_replica_group_rank"} <= poll_fields
    assert {"running", "error"} <= {f.name for f in dataclasses.fields(WorkerStatus)}
    assert {"placement_group_bundle_index", "metadata"} <= {
        f.name for f in dataclasses.fields(Worker)
    }
    for method in ("get_replica_groups", "get_workers", "get_worker_group_state"):
        assert callable(getattr(WorkerGroup, method, None)), method
    assert callable(ReplicaGroup.is_active) and callable(ReplicaGroup.shutdown)


class StandInGroup:
    def __init__(self):
        self.active = True

    def is_active(self):
        return self.active

    def shutdown(self):
        self.active = False


@pytest.fixture
def placed(monkeypatch, tmp_path):
    """A callback watching three replica groups, one per node a, b, c, and the cluster's state
    as the test sets it."""
    workers = [
        SimpleNamespace(
            distributed_context=SimpleNamespace(world_rank=i),
            placement_group_bundle_index=i,
            metadata=SimpleNamespace(node_id=node),
        )
        for i, node in enumerate("abc")
    ]
    groups = [StandInGroup() for _ in workers]
    cluster = SimpleNamespace(
        bundles={0: "a", 1: "b", 2: "c"}, alive={"a", "b", "c"}, draining=set()
    )
    monkeypatch.setattr(
        ClusterView, "of",
        classmethod(lambda cls, _: cls(dict(cluster.bundles), set(cluster.alive), set(cluster.draining))),
    )  # fmt: skip
    callback = ReplaceWhenPlaceable(str(tmp_path))
    callback.after_worker_group_start(
        SimpleNamespace(get_workers=lambda: workers, get_replica_groups=lambda: groups)
    )
    return SimpleNamespace(callback=callback, groups=groups, cluster=cluster, run_dir=tmp_path)


def _died():
    return WorkerHealthCheckFailedError("health check failed", ActorDiedError())


def _poll(placed, *failed, error=_died):
    statuses = {r: WorkerStatus(running=r not in failed, error=error() if r in failed else None)
                for r in range(3)}  # fmt: skip
    status = WorkerGroupPollStatus(
        worker_statuses=statuses, worker_rank_to_replica_group_rank={0: 0, 1: 1, 2: 2}
    )
    placed.callback.after_worker_group_poll_status(status)
    return status.failing_replica_group_indices


def test_a_group_whose_slot_has_no_node_waits_and_the_others_are_replaced(placed):
    placed.cluster.bundles[2] = ""  # node c gone, its bundle waiting to be placed again
    placed.cluster.alive.discard("c")
    assert _poll(placed, 1, 2) == {1}
    assert [g.active for g in placed.groups] == [True, False, False]  # failed ones shut down
    events = read_events(placed.run_dir)
    assert [(e["event"], e["group"]) for e in events] == [("replica_held", 2)]
    placed.cluster.bundles[2], placed.cluster.alive = "d", placed.cluster.alive | {"d"}
    assert _poll(placed, 2) == {2}  # capacity back: replaced there
    events = read_events(placed.run_dir)
    assert [e["event"] for e in events] == ["replica_held", "replica_released"]


def test_a_slot_on_a_draining_node_or_an_unreachable_one_waits(placed):
    placed.cluster.draining.add("c")
    assert _poll(placed, 2) == set()
    placed.cluster.draining.clear()
    unreachable = lambda: WorkerHealthCheckFailedError("x", ActorUnavailableError("x", b"0" * 16))  # noqa: E731
    assert _poll(placed, 2, error=unreachable) == set()  # dead, not marked dead yet
    assert _poll(placed, 2) == {2}  # its process died, its node lives


def test_with_no_group_training_ray_trains_own_handling_restarts_them_all(placed):
    placed.cluster.bundles[2] = ""
    assert _poll(placed, 0, 1, 2) == {0, 1, 2}
