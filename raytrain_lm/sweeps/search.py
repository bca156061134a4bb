"""The Tune side of a sweep: the search space, the scheduler (ASHA, FIFO or PBT), the
searcher, and how many trials run side by side."""

from __future__ import annotations

from functools import partial
from typing import Any

from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

from raytrain_lm.config import RunConfig
from raytrain_lm.runtime import cpus_needed
from raytrain_lm.sweeps.spec import Sweep
from raytrain_lm.sweeps.trial import TIME_ATTR

# The trial's actor only waits on Ray Train, which reserves its own workers: a trial holding
# a whole CPU would keep Train workers (and Ray Data) from scheduling. Tune refuses a trial
# that asks for nothing at all, hence a sliver.
TRIAL_CPU = 0.01


def param_space(
    space: dict[str, dict[str, Any]], mutations: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Tune's search space; PBT's mutated keys not in `space` start from their mutation's
    distribution."""
    space = {**(mutations or {}), **space}

    make = {
        "choice": tune.choice,
        "grid": tune.grid_search,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    return {key: make[kind](args) for key, e in space.items() for kind, args in e.items()}


def derive_max_concurrent(cfg: RunConfig, resources: dict[str, float], gpu: bool) -> int:
    """How many trials fit side by side in `resources` now, at least one: each needs its
    largest worker group plus the CPUs kept for Ray Data (and GPUs when it trains on GPUs),
    plus its own Tune actor. Whether one trial can run at all is `runtime.ensure_ray`'s
    check."""
    scaling = cfg.scaling
    fits = int(resources.get("CPU", 0.0) // (cpus_needed(scaling) + TRIAL_CPU))
    if gpu:
        fits = min(
            fits, int(resources.get("GPU", 0.0) // (scaling.max_size * scaling.gpus_per_worker))
        )
    return max(1, fits)


def _mutation(entry: dict[str, Any]):
    """PBT shifts a `choice` to a neighbouring value and scales a range by 0.8 or 1.2."""
    kind, args = next(iter(entry.items()))
    if kind == "choice":
        return list(args)
    return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[kind](
        *args
    )


def _keep_in_range(bounds: dict[str, tuple[float, float]], config: dict[str, Any]):
    """PBT's custom_explore_fn: a scaled value stays inside the declared range, where
    load_sweep checked it is a valid setting."""
    for key, (low, high) in bounds.items():
        value = config[key]
        config[key] = type(value)(min(max(value, low), high))
    return config


def build_scheduler(sweep: Sweep):
    """Tune's trial scheduler for `sweep`, comparing trials by step."""
    s = sweep.spec.scheduler
    every = sweep.base["checkpoint"]["every_steps"]
    if s.kind == "fifo":
        return FIFOScheduler()
    if s.kind == "pbt":
        bounds = {}
        for key, entry in s.hyperparam_mutations.items():
            kind, args = next(iter(entry.items()))
            if kind != "choice":
                bounds[key] = (args[0], args[1] - 1 if kind == "randint" else args[1])
        return PopulationBasedTraining(
            time_attr=TIME_ATTR,
            perturbation_interval=s.perturbation_interval or every,
            hyperparam_mutations={k: _mutation(e) for k, e in s.hyperparam_mutations.items()},
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
            custom_explore_fn=partial(_keep_in_range, bounds),
            synch=s.synch,
        )
    return ASHAScheduler(
        time_attr=TIME_ATTR,
        # One past the last step: a trial that reaches max_steps must end by itself (summary,
        # final weights, closing its MLflow run), not be stopped by ASHA at its last report.
        max_t=sweep.base["training"]["max_steps"] + 1,
        grace_period=s.grace_period or every,
        reduction_factor=s.reduction_factor,
    )


def build_search_alg(sweep: Sweep):
    """Tune's searcher for `sweep`: None for random sampling (Tune's default)."""
    if sweep.spec.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch  # optuna is optional

        return OptunaSearch(seed=sweep.spec.seed)
    return None
