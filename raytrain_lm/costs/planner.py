"""What a run will cost before it starts: for each accelerator type x worker count x spot or
on-demand, the expected wall time, cost and goodput of training the token budget, and the
checkpoint interval that minimises the expected time (model.py).

Throughput per GPU is the type's peak bf16 FLOP/s (raytrain_lm/devices.py) x an MFU (measured by
a run of yours, `Inputs.mfu`, else `DEFAULT_MFU`) / the model's training FLOPs per token.
Checkpoints write 12 bytes per parameter (fp32 weights and AdamW's two moments); under a
sharded strategy every worker writes its part, so the time is bytes / (workers x storage
bandwidth), else bytes / bandwidth. Interruptions: in restart mode any node's interruption
restarts every worker, so the run's rate is the nodes' rates summed; each costs the training
since the last checkpoint, plus the recovery time (measured, else `DEFAULT_RECOVERY_S`) plus
restoring. Prices are paid for every worker for the whole expected wall time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from raytrain_lm.costs.catalog import Catalog
from raytrain_lm.costs.model import best_interval_s, expected_wall_s, young_daly_interval_s
from raytrain_lm.devices import gpu_peak_flops

# Model FLOPs utilisation assumed for a type no run has measured: what a well-tuned DDP/FSDP
# step of a 100M-10B model reaches on current GPUs with bf16, compile and flash attention
# (nanoGPT's 124M reaches about 0.4-0.5 on A100/H100; larger models more, L4s less).
DEFAULT_MFU = 0.35
# Seconds from an interruption to the next group's first step, before restoring: Ray noticing
# the lost node, the autoscaler bringing another, workers starting (restart mode, measured
# locally at 30-60 s without provisioning; a cloud node adds minutes).
DEFAULT_RECOVERY_S = 300.0
STORAGE_BYTES_PER_S = 500e6  # one worker writing to or reading from a bucket
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two moments
STATE_BYTES_PER_PARAM = 16  # in device memory while training: the gradients too


@dataclass(frozen=True)
class Inputs:
    """Everything besides the catalog; `measured` names the ones that came from a run."""

    tokens: float
    params: int
    flops_per_token: float
    tokens_per_step: int
    mfu: dict[str, float] = field(default_factory=dict)  # by type, measured
    interruptions_per_node_hour: dict[str, float] = field(default_factory=dict)  # measured
    recovery_s: float | None = None  # per incident, measured
    checkpoint_s: float | None = None  # one save, measured
    measured: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Estimate:
    accelerator: str
    capacity: str  # spot | on_demand
    workers: int
    strategy: str
    tokens_per_s: float
    compute_h: float  # the training alone
    wall_h: float  # expected, with checkpoints and interruptions
    cost_usd: float
    goodput: float  # compute_h / wall_h
    interruptions: float  # expected over the run
    checkpoint_every_steps: int | None  # None: only at the end
    young_daly_steps: int | None
    meets_deadline: bool = True
    within_budget: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def strategy_for(params: int, workers: int, memory_gib: float, per_node: int) -> str | None:
    """`parallel.strategy=auto`'s choice (trainer/distributed/parallel.py) at 60 % of a device, or None
    when even fsdp cannot hold the state."""
    budget = 0.6 * memory_gib * 2**30
    state = STATE_BYTES_PER_PARAM * params
    if state <= budget:
        return "ddp"
    group = min(per_node, workers)
    if group < workers and state / group <= budget:
        return "hsdp"
    return "fsdp" if state / workers <= budget else None


def estimate(
    inputs: Inputs, catalog: Catalog, accelerator: str, capacity: str, workers: int
) -> Estimate | None:
    """One candidate, or None when the model cannot fit it or the type has no known peak."""
    kind = catalog.types[accelerator]
    offer = kind.capacities()[capacity]
    peak = kind.peak_tflops * 1e12 if kind.peak_tflops else gpu_peak_flops(accelerator)
    strategy = strategy_for(inputs.params, workers, kind.memory_gib, kind.gpus_per_node)
    if peak is None or strategy is None:
        return None
    mfu = inputs.mfu.get(accelerator, DEFAULT_MFU)
    tokens_per_s = workers * peak * mfu / inputs.flops_per_token
    compute_s = inputs.tokens / tokens_per_s
    writers = workers if strategy != "ddp" else 1
    io_s = CHECKPOINT_BYTES_PER_PARAM * inputs.params / (writers * STORAGE_BYTES_PER_S)
    checkpoint_s = inputs.checkpoint_s if inputs.checkpoint_s is not None else io_s
    nodes = math.ceil(workers / kind.gpus_per_node)
    per_node = 0.0  # on-demand capacity is not taken back
    if capacity == "spot":
        per_node = inputs.interruptions_per_node_hour.get(
            accelerator, offer.interruptions_per_node_hour
        )
    rate = nodes * per_node / 3600
    # A measured recovery ran from the last progress to the next first step: restoring is in it.
    recovery = inputs.recovery_s if inputs.recovery_s is not None else DEFAULT_RECOVERY_S + io_s
    interval = best_interval_s(compute_s, checkpoint_s, rate, recovery)
    wall_s = expected_wall_s(compute_s, interval, checkpoint_s, rate, recovery)
    step_s = inputs.tokens_per_step / tokens_per_s

    def steps(seconds: float) -> int | None:
        return (
            None
            if not math.isfinite(seconds) or seconds >= compute_s
            else max(1, round(seconds / step_s))
        )

    return Estimate(
        accelerator=accelerator,
        capacity=capacity,
        workers=workers,
        strategy=strategy,
        tokens_per_s=tokens_per_s,
        compute_h=compute_s / 3600,
        wall_h=wall_s / 3600,
        cost_usd=offer.usd_per_gpu_hour * workers * wall_s / 3600,
        goodput=compute_s / wall_s,
        interruptions=rate * wall_s,
        checkpoint_every_steps=steps(interval),
        young_daly_steps=steps(young_daly_interval_s(checkpoint_s, rate, recovery)),
    )


def plan_candidates(
    inputs: Inputs,
    catalog: Catalog,
    worker_counts: list[int],
    deadline_h: float | None = None,
    budget_usd: float | None = None,
) -> list[Estimate]:
    """Every candidate that fits, cheapest first, each marked against the deadline and the
    budget."""
    found = []
    for accelerator, kind in catalog.types.items():
        for capacity in kind.capacities():
            for workers in worker_counts:
                e = estimate(inputs, catalog, accelerator, capacity, workers)
                if e is None:
                    continue
                found.append(
                    Estimate(
                        **{
                            **e.as_dict(),
                            "meets_deadline": deadline_h is None or e.wall_h <= deadline_h,
                            "within_budget": budget_usd is None or e.cost_usd <= budget_usd,
                        }
                    )
                )
    # Costs within a cent are a tie (the same GPU-hours): the sooner one first.
    return sorted(found, key=lambda e: (round(e.cost_usd, 2), e.wall_h))


def cheapest_in_time(estimates: list[Estimate]) -> Estimate | None:
    return next((e for e in estimates if e.meets_deadline and e.within_budget), None)
