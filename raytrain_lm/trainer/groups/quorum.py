"""torchft for replica groups (replicas.py): the Lighthouse's settings and address, and this
group's `Manager` (a quorum before every step, healing from a peer, the commit vote).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from datetime import timedelta
from typing import Any

import torch

from raytrain_lm.config import RunConfig
from raytrain_lm.trainer.groups import torchft_adapter
from raytrain_lm.trainer.progress import announce


def lighthouse_settings(cfg: RunConfig) -> dict[str, Any]:
    """torchft's Lighthouse (run by Ray Train on the head): a quorum needs at least
    `scaling.min_workers` groups; a silent group is left out after the heartbeat timeout."""
    replicas = cfg.replicas
    return {
        "min_replicas": cfg.scaling.min_size,
        "join_timeout_ms": int(join_timeout_s(cfg) * 1000),
        "heartbeat_timeout_ms": int(replicas.heartbeat_timeout_s * 1000),
        "quorum_tick_ms": 100,
    }


def join_timeout_s(cfg: RunConfig) -> float:
    """How long a quorum waits for live groups that have not asked yet. In rounds groups
    reach a sync apart by their speeds over a whole round, not one step."""
    if cfg.parallel.in_rounds:
        return max(cfg.replicas.join_timeout_s, cfg.diloco.join_timeout_s)
    return cfg.replicas.join_timeout_s


def quorum_timeout_s(cfg: RunConfig) -> float:
    """One attempt at a quorum; in rounds it outlasts the Lighthouse's wait for groups
    still in their round, so that waiting for them is not taken for a failed attempt."""
    if cfg.parallel.in_rounds:
        return max(cfg.replicas.quorum_timeout_s, join_timeout_s(cfg) + 10)
    return cfg.replicas.quorum_timeout_s


LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # set in every worker by Ray Train's TorchftConfig


class LighthouseLost(RuntimeError):
    """The torchft Lighthouse (on the head) does not answer: no quorum can form again."""

    def __init__(self, address: str):
        super().__init__(f"the torchft Lighthouse at {address} does not answer")


def lighthouse_answers(address: str | None = None, timeout_s: float = 3.0) -> bool:
    """Whether something listens at the Lighthouse's address (a TCP connect); `address`:
    the one this group uses (NodeAddresses.lighthouse), else the one Ray Train handed out."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(address or os.environ.get(LIGHTHOUSE_ENV, ""))
    if not parts.hostname or not parts.port:
        return True  # not known here: assume it is there
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def resolves_to_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP) resolves to a loopback address, as an image's
    /etc/hosts makes of its own hostname (127.0.0.1 here, 127.0.1.1 on Debian's defaults)."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def reachable_lighthouse(address: str, node_ip: str, head_ip: str | None, is_loopback=None) -> str:
    """The Lighthouse's address as a group on the node with `node_ip` can reach it.

    The Lighthouse advertises `http://<its hostname>:<port>`, and Ray Train's TorchftConfig
    hands that to every worker. Where the hostname resolves to loopback, only the Lighthouse's
    own node can reach it: elsewhere the host becomes `head_ip` (Ray Train runs the Lighthouse
    on the head; it listens on every interface). Same node, or a hostname that resolves to a
    real address: unchanged."""
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    if not parts.hostname or not head_ip or node_ip == head_ip:
        return address
    if not (is_loopback or resolves_to_loopback)(parts.hostname):
        return address
    host = f"[{head_ip}]" if ":" in head_ip else head_ip
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{host}{port}").geturl()


def interface_with(ip: str, interfaces: dict[str, list[Any]]) -> str | None:
    """The name of the interface holding `ip`, in `psutil.net_if_addrs()`'s shape."""
    for name, addresses in interfaces.items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return None


class NodeAddresses:
    """What this group advertises to the other groups: its Ray node's IP, not its hostname.

    torchft and gloo name a process by `socket.gethostname()`: the Manager's address (which the
    Lighthouse hands to the other groups), the Lighthouse's own (above), and gloo's default
    device, which binds the address the hostname resolves to. Where that is loopback (an
    /etc/hosts entry), groups on other nodes reach nothing, or themselves. Ray already knows an
    address every node reaches: the node IP it registered with (MASTER_ADDR, this group's
    store, is that too). So the Manager advertises it, the Lighthouse is reached at the head's,
    and gloo is pointed at the interface that holds it (GLOO_SOCKET_IFNAME, unless set).
    TORCHFT_LIGHTHOUSE itself is left as Ray Train set it: the groups name the run's segment
    after it (replicas.py), which must read the same on every node."""

    def __init__(self):
        import socket

        import ray

        self.node_ip = ray.util.get_node_ip_address()
        gcs_host = ray.get_runtime_context().gcs_address.rpartition(":")[0].strip("[]")
        self.hostname = f"[{self.node_ip}]" if ":" in self.node_ip else self.node_ip
        self.lighthouse = reachable_lighthouse(
            os.environ.get(LIGHTHOUSE_ENV, ""), self.node_ip, gcs_host or None
        )
        if "GLOO_SOCKET_IFNAME" not in os.environ and resolves_to_loopback(socket.gethostname()):
            import psutil

            interface = interface_with(self.node_ip, psutil.net_if_addrs())
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface


_MANAGER_LOG = logging.getLogger("torchft.manager")


class _NoFlightRecorder(logging.Filter):
    """torchft warns at every new quorum where torch has no NCCL flight recorder (any CPU
    build), about traces that only NCCL writes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


class TooFewReplicas(RuntimeError):
    """Fewer than `scaling.min_workers` groups for `replicas.min_workers_wait_s`: the run ends
    with this reason (launch.py), after the groups' checkpoint."""


class ByteCounter:
    """Bytes this group handed to its all-reduces (the payload; a ring sends about twice it)."""

    def __init__(self):
        self.sent = 0

    def add(self, tensor: torch.Tensor, element_size: int | None = None) -> None:
        self.sent += tensor.numel() * (element_size or tensor.element_size())


class Quorum:
    """This group's torchft Manager: a quorum before every step, healing, the commit vote."""

    def __init__(self, cfg: RunConfig, group: int, device: torch.device, save, load):
        self.bytes = ByteCounter()
        # torchft logs every quorum and vote at INFO (Rust and Python; the structured
        # "torchft_quorums"/"torchft_commits" records have an empty message, which Ray's
        # handler prints as a blank line per step): our events say it once.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if not any(isinstance(f, _NoFlightRecorder) for f in _MANAGER_LOG.filters):
            _MANAGER_LOG.addFilter(_NoFlightRecorder())
        # Its checkpoint transport (healing) trips two torch warnings meant for its authors.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchft\.")
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        timeout = timedelta(seconds=cfg.replicas.timeout_s)
        pg = ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else ProcessGroupNCCL()
        self.min_groups = cfg.scaling.min_size
        self.wait_s = cfg.replicas.min_workers_wait_s
        self.addresses = NodeAddresses()  # before the process group's first gloo device
        self.manager = Manager(
            pg=pg,
            load_state_dict=load,
            state_dict=save,
            min_replica_size=self.min_groups,
            use_async_quorum=False,  # a healed group takes part in the step it healed in
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s(cfg)),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            replica_id=f"raytrain_lm_{group}",
            lighthouse_addr=self.addresses.lighthouse or None,
            hostname=self.addresses.hostname,
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
            init_sync=False,  # every group builds the same weights from the seed
        )
        torchft_adapter.check_manager(self.manager)

    def form(self) -> tuple[int | None, int]:
        """Waits for a quorum (healing first if this group is behind); returns this group's
        participating rank (None: not taking part) and the number of participants. Raises
        LighthouseLost when the Lighthouse no longer answers, and after
        `replicas.min_workers_wait_s` without a quorum, a one-line reason."""
        waited_from = time.monotonic()
        while True:
            try:
                self.manager.start_quorum()
                break
            except Exception as exc:  # no quorum within replicas.quorum_timeout_s
                torchft_adapter.forget_failed_quorum(self.manager)
                if not lighthouse_answers(self.addresses.lighthouse):
                    raise LighthouseLost(self.addresses.lighthouse or "?") from None
                waited = time.monotonic() - waited_from
                if waited > self.wait_s:
                    raise TooFewReplicas(
                        f"no quorum of scaling.min_workers={self.min_groups} replica groups "
                        f"for {waited:.0f} s: too few are alive, and no capacity came for "
                        f"more within replicas.min_workers_wait_s ({type(exc).__name__})"
                    ) from None
                announce(
                    f"waiting for scaling.min_workers={self.min_groups} replica groups "
                    f"({waited:.0f} s of replicas.min_workers_wait_s={self.wait_s:g})"
                )
        return self.manager.participating_rank(), self.manager.num_participants()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over this step's participants. If the reduction failed the step
        does not commit, and `values` holds anything (torchft leaves a group its own after an
        error, or a part-reduced vector): use it only once the step commits."""
        from torch.distributed import ReduceOp

        self.bytes.add(values)
        self.manager.allreduce(values, reduce_op=ReduceOp.SUM).wait()
        return values

    def reduce_step(self, model: torch.nn.Module, values: torch.Tensor) -> torch.Tensor:
        """The participants' gradients averaged in one reduction after the backward, and
        `values` summed (as `sum`); both reductions are in flight before either is waited for.

        Not torchft's DDP wrapper (bucketed, overlapping the backward): in torchft 0.2 its
        hook fails an assertion when a peer dies during the reduction, which ends the
        survivor too. A failed reduction here only marks the step as not to commit."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        from torch.distributed import ReduceOp

        params = [p for p in model.parameters() if p.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        self.bytes.add(flat)
        self.bytes.add(values)
        averaging = self.manager.allreduce(flat, reduce_op=ReduceOp.AVG)
        summing = self.manager.allreduce(values, reduce_op=ReduceOp.SUM)
        averaging.wait()
        summing.wait()
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(averaged)
        return values

    def commit(self) -> bool:
        return self.manager.should_commit()
