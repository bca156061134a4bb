"""Connecting to Ray, sized for the machine, and refusing what cannot be scheduled."""

from __future__ import annotations

import os

from raytrain_lm.config import ScalingConfig
from raytrain_lm.errors import UserError


def _log_level() -> str:
    return os.environ.get("RAY_LOGGING_LEVEL", "INFO")


def cpus_needed(scaling: ScalingConfig) -> float:
    return scaling.num_workers * scaling.cpus_per_worker + scaling.data_cpus


def ensure_ray(scaling: ScalingConfig) -> None:
    """Joins `scaling.ray_address`, reuses a running Ray, or starts a local one big enough.

    Locally, logical CPUs may exceed physical cores: Train workers and Ray Data readers then
    share cores, which is fine for tiny models and avoids the pipeline deadlock that happens
    when Train reserves every CPU and Data tasks cannot be scheduled.
    """
    import ray

    if not ray.is_initialized():
        if scaling.ray_address:
            ray.init(address=scaling.ray_address, log_to_driver=True)
        else:
            logical = max(os.cpu_count() or 1, int(cpus_needed(scaling) + 0.999))
            ray.init(num_cpus=logical, log_to_driver=True, logging_level=_log_level())
    check_schedulable(scaling, ray.cluster_resources())


def check_schedulable(scaling: ScalingConfig, resources: dict[str, float]) -> None:
    total = resources.get("CPU", 0.0)
    need = cpus_needed(scaling)
    if scaling.data_cpus < 0.1 * scaling.num_workers:
        raise UserError(
            f"scaling.data_cpus ({scaling.data_cpus}) leaves Ray Data no CPU to read with; "
            f"set at least {0.1 * scaling.num_workers:g} (0.1 per worker)"
        )
    if need > total:
        raise UserError(
            f"cannot schedule: {scaling.num_workers} workers x {scaling.cpus_per_worker:g} CPU "
            f"+ {scaling.data_cpus:g} CPU for Ray Data needs {need:g} CPUs, the cluster has {total:g}"
        )
    if scaling.use_gpu is True and resources.get("GPU", 0.0) < scaling.num_workers:
        raise UserError(
            f"scaling.use_gpu is true but the cluster has {resources.get('GPU', 0.0):g} GPUs "
            f"for {scaling.num_workers} workers"
        )


def use_gpu(scaling: ScalingConfig) -> bool:
    if scaling.use_gpu == "auto":
        import ray

        return ray.cluster_resources().get("GPU", 0.0) >= scaling.num_workers
    return bool(scaling.use_gpu)


def ensure_local_ray() -> None:
    """A Ray to run a data job on: the running one, $RAY_ADDRESS, or a new local one."""
    import ray

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=True)
        else:
            # logical CPUs also cover the default training run that usually follows
            ray.init(
                num_cpus=max(4, os.cpu_count() or 1), log_to_driver=True, logging_level=_log_level()
            )
