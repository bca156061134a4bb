"""Replica groups: a lost group is replaced only where its replacement can start, so that one
group waiting for capacity never keeps the others' losses from being handled.

Ray Train 2.60 replaces a lost replica group in its old placement-group bundle and waits for
that actor to start without a timeout, inside its control loop. When the bundle has no node to
go to (its node was drained or killed and no other has a free slot) the controller blocks for
good: it polls no more, and a later loss, even of a group whose slot is free on a live node,
is never replaced (issue 44: after the first spot notice a run could only shrink).

`ReplaceWhenPlaceable` runs in the controller after every poll, before the controller acts on
it. It reports a failed group whose bundle cannot take a replacement now as still running, so
the controller replaces the others and keeps polling; once the bundle has a live node again
(capacity came back) the failure goes through and the group is replaced there. It also shuts
failing groups down first, as a replacement itself does: a replacement asks every other active
group to clear its result queue, without handling errors, and a second dead group still active
would make the controller give up the run.

This leans on Ray Train 2.60's developer API and internals (ray is pinned to 2.60.x):
`WorkerGroupCallback.after_worker_group_poll_status`, the poll's `worker_statuses` (a dict we
update in place), `WorkerStatus`, each worker's `placement_group_bundle_index` and
`metadata.node_id`, the worker group's placement group, its replica groups' `is_active` and
`shutdown`. tests/test_replica_placement.py checks that Ray still has them.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from raytrain_lm.run_events.journal import append_event

logger = logging.getLogger(__name__)


class ReplaceWhenPlaceable(WorkerGroupCallback):
    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._worker_group: Any = None
        self._held: dict[int, str] = {}  # replica group -> why it waits

    def after_worker_group_start(self, worker_group) -> None:
        self._worker_group, self._held = worker_group, {}

    def before_worker_group_shutdown(self, worker_group) -> None:
        self._worker_group = None

    def before_worker_group_abort(self, worker_group_context) -> None:
        self._worker_group = None

    def after_worker_group_poll_status(self, status) -> None:
        try:
            self._hold_unplaceable(status)
        except Exception:  # never break Ray Train's control loop: it then acts as without us
            logger.exception("raytrain-lm: checking where lost replica groups can go failed")

    def _hold_unplaceable(self, status) -> None:
        from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus

        to_group, errors = status.worker_rank_to_replica_group_rank, status.errors
        if not errors or not to_group or self._worker_group is None:
            if not errors:
                self._note({})
            return
        groups = self._worker_group.get_replica_groups() or []
        for group in sorted({to_group[r] for r in errors if r in to_group}):
            if group < len(groups) and groups[group].is_active():
                groups[group].shutdown()
        statuses = status.worker_statuses
        if not any(s.running and s.error is None for s in statuses.values()):
            self._note({})  # no group trains: Ray Train's own handling (a restart of all)
            return
        workers = {w.distributed_context.world_rank: w for w in self._worker_group.get_workers()}
        view = ClusterView.of(self._worker_group)
        held = {
            to_group[rank]: why
            for rank, error in errors.items()
            if rank in workers and (why := view.why_not_now(workers[rank], error))
        }
        for rank in list(errors):
            if to_group.get(rank) in held:
                statuses[rank] = WorkerStatus(running=True, error=None)
        self._note(held)

    def _note(self, held: dict[int, str]) -> None:
        for group in sorted(set(held) - set(self._held)):
            print(f"[raytrain-lm] replica group {group} waits for capacity: {held[group]}")
            append_event(self.run_dir, "replica_held", group=group, why=held[group])
        for group in sorted(set(self._held) - set(held)):
            append_event(self.run_dir, "replica_released", group=group)
        self._held = held


class ClusterView:
    """Ray's control plane now: where each bundle of the group's placement group is, which
    nodes are alive, which are being drained."""

    def __init__(self, bundle_nodes: dict[int, str], alive: set[str], draining: set[str]):
        self.bundle_nodes, self.alive, self.draining = bundle_nodes, alive, draining

    @classmethod
    def of(cls, worker_group) -> ClusterView:
        import ray
        from ray._private.state import state

        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
        table = ray.util.placement_group_table(pg)
        return cls(
            {int(k): v for k, v in table.get("bundles_to_node_id", {}).items()},
            {n["NodeID"] for n in ray.nodes() if n.get("Alive")},
            set(state.get_draining_nodes()),
        )

    def why_not_now(self, worker, error) -> str | None:
        """Why `worker`'s replacement could not start now in its bundle (None: it can)."""
        from ray.exceptions import ActorUnavailableError

        node = self.bundle_nodes.get(worker.placement_group_bundle_index)
        if not node or node not in self.alive:
            return "its slot has no node"
        if node in self.draining:
            return "its slot is on a draining node"  # Ray grants no lease there
        cause = getattr(error, "health_check_failure", error)
        if node == worker.metadata.node_id and isinstance(cause, ActorUnavailableError):
            return "its node is unreachable"  # dead, but not marked dead yet
        return None
