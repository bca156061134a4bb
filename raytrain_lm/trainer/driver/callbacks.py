"""A Ray Train callback (runs in the controller): timestamps failures for goodput, and after
a node loss makes sure the restart is sized for the nodes that are left.

Ray Train notices a lost node by its own worker health check, often before Ray's control
plane has marked the node dead, and sizes the restart from a capacity view that still lists
it (see capacity.py). Waiting here (briefly) for the node to be marked dead and refreshing
that view lets the restart be placed at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.train import UserCallback

from raytrain_lm.run_events.journal import append_event, read_events
from raytrain_lm.trainer.components.stop_requests import REPLICAS_DONE
from raytrain_lm.trainer.driver.capacity import refresh_capacity_view

logger = logging.getLogger(__name__)


def alive_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


CONTROLLER_LOGGER = "ray.train.v2._internal.execution.controller.controller"
BACKEND_LOGGER = "ray.train.v2._internal.callbacks.backend_setup"
# What the controller logs, whole tracebacks included, when workers or their node are gone and
# it goes on (restarts, or replaces a replica group): the error's first and last lines (what
# failed, and why: "The actor died because its node has died") say all a user can act on.
_WORKERS_LOST = {
    "WorkerGroupStartupTimeoutError",
    "WorkerGroupStartupFailedError",
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
}


class _OneLineWorkerLosses(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ not in _WORKERS_LOST:
            return True
        message = record.getMessage()
        lines = [line.strip() for line in f"{message}\n{error}".splitlines() if line.strip()]
        why = [line for line in lines if "died because" in line or "unavailable" in line]
        head = message.splitlines()[0] if message else type(error).__name__
        record.msg, record.args = "%s", (" ".join(dict.fromkeys([head, *why[-1:]])),)
        record.exc_info, record.exc_text = None, None
        return True


class FailureEvents(UserCallback):
    def __init__(self, run_dir: str, node_loss_wait_s: float = 0.0):
        self.run_dir = run_dir
        self.node_loss_wait_s = node_loss_wait_s
        self._handled: set[str] = set()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in the controller's process: the one place its logger can be reached.
        self.__dict__.update(state)
        for name in (CONTROLLER_LOGGER, BACKEND_LOGGER):
            log = logging.getLogger(name)
            if not any(isinstance(f, _OneLineWorkerLosses) for f in log.filters):
                log.addFilter(_OneLineWorkerLosses())

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        kinds = sorted({type(e).__name__ for e in worker_exceptions.values()})
        events = read_events(self.run_dir)
        segment = _current_segment(events)
        key = _failure_key(events, segment, sorted(worker_exceptions))
        if key in self._handled:
            return  # the controller reports the same failure on every poll until it acts
        self._handled.add(key)
        append_event(
            self.run_dir, "failure_detected", ranks=sorted(worker_exceptions), errors=kinds
        )
        # Survivors' collective errors usually arrive before the lost node's own, so any
        # failure may be a node loss: look for one, for at most node_loss_wait_s.
        if self.node_loss_wait_s > 0 and segment and segment.get("nodes"):
            self._wait_for_lost_nodes(set(segment["nodes"]))

    def _wait_for_lost_nodes(self, nodes_at_start: set[str]) -> None:
        deadline = time.monotonic() + self.node_loss_wait_s
        while time.monotonic() < deadline:
            lost = nodes_at_start - alive_node_ids()
            if lost:
                append_event(self.run_dir, "nodes_lost", nodes=sorted(lost))
                refresh_capacity_view()
                return
            time.sleep(0.25)


def _current_segment(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    starts = [e for e in events if e["event"] == "segment_start"]
    return starts[-1] if starts else None


def _failure_key(
    events: list[dict[str, Any]], segment: dict[str, Any] | None, ranks: list[int]
) -> tuple:
    """What tells one failure from the next: a worker group's restart starts a segment;
    replica groups stay in one segment and are replaced one by one, so there each failed
    group's process (its latest `replica_start`) tells them apart."""
    pids = {e["group"]: e["pid"] for e in events if e["event"] == "replica_start"}
    return ((segment or {}).get("segment", ""), tuple((r, pids.get(r)) for r in ranks))


class EndAfterReplicasDone(UserCallback):
    """Replica groups: ends Ray Train's controller once the groups are done, if it is still
    waiting then.

    Ray Train 2.60 replaces a lost replica group in its old placement-group slot and waits for
    that, without a timeout, inside its control loop. When the lost node's capacity never
    comes back, the run can finish (the survivors reached the end, or stopped, with their
    checkpoint) while the controller still waits for a group nobody needs. A thread in the
    controller's process watches the run's events: `grace_s` after the chief's
    `replicas_done`, it ends the controller (`ray.kill`), and the driver, which finds the
    run's checkpoint there, carries on (launch.py)."""

    def __init__(self, run_dir: str, grace_s: float):
        self.run_dir, self.grace_s = run_dir, grace_s

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in the controller's process, the one place it can end the controller; and
        # in every worker's, with the run's config, where its watch would end that worker.
        self.__dict__.update(state)
        # Ray Train unpickles the run's callbacks more than once in its controller: one watch
        if _in_controller() and self.run_dir not in _WATCHED:
            import threading

            _WATCHED.add(self.run_dir)
            threading.Thread(target=self._watch, name="replicas-done", daemon=True).start()

    def _watch(self) -> None:
        import ray

        started = time.time()
        while True:
            time.sleep(1.0)
            done = [
                e for e in read_events(self.run_dir)
                if e["event"] == REPLICAS_DONE and e["t"] >= started
            ]  # fmt: skip
            # Too few groups: nothing is coming, and the controller would restart the rest.
            grace_s = 0.0 if done and done[0].get("too_few") else self.grace_s
            if done and time.time() - done[0]["t"] > grace_s:
                append_event(self.run_dir, "controller_ended", waited_s=grace_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


_WATCHED: set[str] = set()  # run directories a replicas-done watch runs for, in this process


def _in_controller() -> bool:
    """Whether this process is Ray Train's controller (an actor of class TrainController)."""
    import ray

    try:
        actor = ray.get_runtime_context().current_actor
    except Exception:  # not an actor: the driver
        return False
    return actor._ray_actor_creation_function_descriptor.class_name == "TrainController"
