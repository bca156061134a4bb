"""Connecting to Ray, sized for the machine, and refusing what cannot be scheduled."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from raytrain_lm.config import ScalingConfig
from raytrain_lm.console import (
    plain_when_not_a_terminal,
    quiet_token_auth_notice,
    quiet_worker_output,
)
from raytrain_lm.errors import UserError

API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


def _log_level() -> str:
    return os.environ.get("RAY_LOGGING_LEVEL", "INFO")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another Ray may hold the defaults)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def naming_api_server(url: str) -> Iterator[None]:
    """While inside, Ray processes started from here learn their cluster's API server.

    Ray Train frees a stopped run's placement group from a helper that otherwise finds the
    cluster by scanning this machine: with a second Ray running here (another user, a test
    suite) it finds several, gives up, and the run's CPUs stay reserved. Ray's processes
    inherit the variable when they start; it is removed again so that this process's own
    subprocesses (another cluster's `ray start`, say) do not."""
    os.environ[API_SERVER_ENV] = url
    try:
        yield
    finally:
        os.environ.pop(API_SERVER_ENV, None)


def init_local_ray(**kwargs) -> None:
    """Starts a local Ray whose processes know its API server's address (see
    `naming_api_server`)."""
    import ray

    if os.environ.get(API_SERVER_ENV):
        ray.init(address="local", **kwargs)
        return
    port = free_port()
    with naming_api_server(f"http://127.0.0.1:{port}"):
        ray.init(
            address="local",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            **kwargs,
        )


def cpus_needed(scaling: ScalingConfig, workers: int | None = None) -> float:
    workers = scaling.max_size if workers is None else workers
    return workers * scaling.cpus_per_worker + scaling.data_cpus


def joins_cluster(scaling: ScalingConfig) -> bool:
    """Whether the run joins a cluster we did not start (`scaling.ray_address` or
    $RAY_ADDRESS). Such a cluster may autoscale: `check_schedulable` does not take its
    resources now for its limit."""
    return bool(scaling.ray_address or os.environ.get("RAY_ADDRESS"))


def ensure_ray(scaling: ScalingConfig, extra_cpus: float = 0.0) -> None:
    """Joins `scaling.ray_address`, reuses a running Ray, or starts a local one big enough
    for the run plus `extra_cpus` (a sweep's trial actors).

    Locally, logical CPUs may exceed physical cores: Train workers and Ray Data readers then
    share cores, which is fine for tiny models and avoids the pipeline deadlock that happens
    when Train reserves every CPU and Data tasks cannot be scheduled.
    """
    import ray

    plain_when_not_a_terminal()  # before ray.init logs (see console.py)
    quiet_token_auth_notice()
    if not ray.is_initialized():
        if joins_cluster(scaling):
            # an existing cluster is sized by its own config: no num_cpus here
            ray.init(address=scaling.ray_address, log_to_driver=True, logging_level=_log_level())
        else:
            needed = cpus_needed(scaling) + extra_cpus
            logical = max(os.cpu_count() or 1, math.ceil(needed))
            init_local_ray(num_cpus=logical, log_to_driver=True, logging_level=_log_level())
    quiet_worker_output()  # whoever started this Ray (a notebook often has)
    check_schedulable(
        scaling,
        ray.cluster_resources(),
        fixed_size=not joins_cluster(scaling),
        extra_cpus=extra_cpus,
    )


def check_schedulable(
    scaling: ScalingConfig,
    resources: dict[str, float],
    fixed_size: bool = True,
    extra_cpus: float = 0.0,
) -> None:
    """Refuses what can never run. On a cluster of `fixed_size` (a local Ray) the smallest
    allowed worker group, the Ray Data budget and `extra_cpus` (a sweep trial's actor) must
    fit now, with GPUs for the group when it trains on GPUs; an autoscaling cluster may still
    add nodes, so only the budget rule applies there."""
    workers = scaling.min_size
    if scaling.data_cpus < 0.1 * scaling.max_size:
        raise UserError(
            f"scaling.data_cpus ({scaling.data_cpus}) leaves Ray Data no CPU to read with; "
            f"set at least {0.1 * scaling.max_size:g} (0.1 per worker)"
        )
    if not fixed_size:
        return
    total = resources.get("CPU", 0.0)
    need = cpus_needed(scaling, workers) + extra_cpus
    if need > total:
        extra = f" + {extra_cpus:g} CPU for the sweep trial's actor" if extra_cpus else ""
        raise UserError(
            f"cannot schedule: {workers} workers x {scaling.cpus_per_worker:g} CPU "
            f"+ {scaling.data_cpus:g} CPU for Ray Data{extra} needs {need:g} CPUs, "
            f"the cluster has {total:g}"
        )
    gpus = resources.get("GPU", 0.0)
    if use_gpu(scaling, resources) and gpus < workers * scaling.gpus_per_worker:
        why = f"scaling.use_gpu {str(scaling.use_gpu).lower()}"
        if scaling.accelerator_type is not None:
            why += f", scaling.accelerator_type {scaling.accelerator_type}"
        raise UserError(
            f"cannot schedule: {workers} workers x {scaling.gpus_per_worker:g} GPU ({why}) "
            f"need {workers * scaling.gpus_per_worker:g} GPUs, the cluster has {gpus:g}"
        )
    for name, amount in scaling.worker_resources.items():
        if resources.get(name, 0.0) < workers * amount:
            raise UserError(
                f"cannot schedule: {workers} workers need {workers * amount:g} of resource "
                f"'{name}' (scaling.worker_resources), the cluster has {resources.get(name, 0.0):g}"
            )


def use_gpu(scaling: ScalingConfig, resources: dict[str, float] | None = None) -> bool:
    """Whether workers train on GPUs. `auto` means yes when `scaling.accelerator_type` names
    one, else when the cluster has a GPU per worker of the smallest group now (`resources`,
    default Ray's): GPU nodes an autoscaler could still add are not counted."""
    if scaling.use_gpu != "auto":
        return bool(scaling.use_gpu)
    if scaling.accelerator_type is not None:
        return True
    if resources is None:
        import ray

        resources = ray.cluster_resources()
    return resources.get("GPU", 0.0) >= scaling.min_size


def ensure_local_ray() -> None:
    """A Ray to run a data job on: the running one, $RAY_ADDRESS, or a new local one."""
    import ray

    plain_when_not_a_terminal()
    quiet_token_auth_notice()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=True, logging_level=_log_level())
        else:
            # logical CPUs also cover the default training run that usually follows
            init_local_ray(
                num_cpus=max(4, os.cpu_count() or 1),
                log_to_driver=True,
                logging_level=_log_level(),
            )
    quiet_worker_output()
