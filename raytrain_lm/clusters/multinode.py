"""A multi-node Ray in this process, whose nodes can be killed, drained and added while a run
trains, and helpers to run a training in the background and watch its event log meanwhile.
The chaos tests, the recovery benchmark (benchmarks/recovery.py) and the elastic notebook use it.

Each worker node offers one `trainslot` resource; runs pin one worker per slot
(`scaling.worker_resources.trainslot=1`), so killing a node takes exactly one worker away.
The head keeps the CPUs that Ray Data reads with, like a real cluster's CPU head. All nodes
share the head's session dir; `ray.cluster_utils.Cluster` starts a log monitor on the head
only, so each worker line reaches the driver once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_lm.run_events.journal import read_events
from raytrain_lm.runtime import free_port, naming_api_server

SLOT = "trainslot"
# A run that trains in seconds on a laptop CPU: a 2-layer model on text that ships with Python
# (the recovery benchmark's runs and the test suite's).
TINY_MODEL = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.sources=builtin:python-docs",
    "data.max_source_bytes=300000",
    "training.progress=false",
    "training.sample_tokens=0",
]
# Notice a dead node in about 3 s instead of Ray's default 30 s or more.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


# A node that failed to start for one of these is started again: it missed Ray's fixed 30 s
# to register (a raylet on a loaded 2-core machine can), or the head's dashboard port, free
# when chosen, was taken by the head's own GCS in the meantime (Ray picks that one itself).
RETRYABLE = ("timed out during startup", "because it's already occupied")


def _start_node(start: Callable[[], Any], attempts: int = 3) -> Any:
    """Runs `start` (a `Cluster.add_node`), again if it failed for a RETRYABLE reason. The
    failed attempt's processes (this process's new descendants) are killed first, so no
    half-started node lingers."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return start()
        except Exception as error:
            if not any(reason in str(error) for reason in RETRYABLE) or attempt == attempts:
                raise
            leftovers = [p for p in me.children(recursive=True) if p.pid not in before]
            for process in leftovers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(leftovers, timeout=10)
            why = next(reason for reason in RETRYABLE if reason in str(error))
            print(
                f"[raytrain-lm] a Ray node did not start ({why}); retrying ({attempt}/{attempts})"
            )
    raise AssertionError("unreachable")


class LocalCluster:
    """A Ray head plus `workers` single-slot worker nodes, connected to this process."""

    def __init__(
        self,
        workers: int = 3,
        head_cpus: int = 2,
        cpus_per_node: int = 1,
        node_ip: str | None = None,
    ):
        """`node_ip`: the address every node here registers with (Ray's guess if None), so
        that nodes elsewhere (another network namespace) can join them."""
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        # Read by Ray Train's controller, which inherits it from the head's processes: after a
        # node loss the survivors' process-group teardown cannot finish, so don't wait 30 s.
        os.environ.setdefault("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "3")
        self.cpus_per_node = cpus_per_node
        self.node_ip = {"node_ip_address": node_ip} if node_ip else {}
        self.cluster = Cluster(initialize_head=False)

        def start_head():
            port = free_port()  # another Ray on this machine may hold 8265; a new one each try
            self.api_server = f"http://127.0.0.1:{port}"
            with naming_api_server(self.api_server):
                return self.cluster.add_node(
                    num_cpus=head_cpus,
                    include_dashboard=True,  # Ray Train V2 polls the state API
                    dashboard_port=port,
                    _system_config=FAST_HEALTH_CHECKS,
                    **self.node_ip,
                )

        _start_node(start_head)
        self.nodes = [self.add_node() for _ in range(workers)]
        ray.init(address=self.cluster.address, _node_ip_address=node_ip)

    @property
    def address(self) -> str:
        return self.cluster.address

    def overrides(self) -> list[str]:
        """Config overrides that place one worker per slot and start worker groups fast."""
        return [
            f"scaling.worker_resources.{SLOT}=1",
            f"scaling.cpus_per_worker={self.cpus_per_node}",
            "fault.worker_start_timeout_s=15",
            "fault.health_check_s=1",
            "fault.preemption_check_s=1",
            "scaling.resize_check_s=5",
        ]

    def add_node(self):
        with naming_api_server(self.api_server):
            node = _start_node(
                lambda: self.cluster.add_node(
                    num_cpus=self.cpus_per_node, resources={SLOT: 1}, **self.node_ip
                )
            )
        if hasattr(self, "nodes"):
            self.nodes.append(node)
        return node

    def kill_node(self, node=None):
        """Kills a worker node's processes at once, like a machine that vanished."""
        node = node or self.nodes[-1]
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        return node

    def drain_node(self, node=None, deadline_s: float = 30.0, reason: str = "PREEMPTION"):
        """Tells Ray a node will be reclaimed in `deadline_s`, as a cloud's spot notice does."""
        import ray
        from ray.core.generated import autoscaler_pb2

        node = node or self.nodes[-1]
        client = ray._raylet.GcsClient(address=self.cluster.address)
        accepted, why = client.drain_node(
            node.node_id,
            autoscaler_pb2.DrainNodeReason.Value(f"DRAIN_NODE_REASON_{reason}"),
            "raytrain-lm chaos",
            int(time.time() * 1000 + deadline_s * 1000),
        )
        if not accepted:
            raise RuntimeError(f"drain of node {node.node_id} refused: {why}")
        return node

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


class Background:
    """Runs `fn` in a thread (node changes must happen on the main thread) and keeps the
    result or the exception."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the caller by wait()
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run still going after {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


def wait_for_event(
    run_dir: str | Path,
    matches: Callable[[dict[str, Any]], bool],
    timeout: float,
    after: float = 0.0,
    still_running: Background | None = None,
) -> dict[str, Any]:
    """The first event in the run's log newer than `after` that `matches`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for event in read_events(run_dir):
            if event["t"] >= after and matches(event):
                return event
        if still_running is not None and not still_running.running:
            still_running.wait(0)  # raises the run's error, if any
            raise AssertionError("the run ended before the awaited event")
        time.sleep(0.2)
    raise TimeoutError(f"no matching event in {run_dir} within {timeout:.0f} s")


def segments(run_dir: str | Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["event"] == "segment_start"]
