"""The `scaling` section: how many workers, of what kind, and how they share the batch. Ray
placement (runtime.py, placement.py) reads only this; its elastic bounds are the world sizes
that the run-wide batch check (run.py) walks.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_lm.config.base import _Section


class ScalingConfig(_Section):
    num_workers: int = Field(2, ge=1, description="workers for a fixed-size run")
    min_workers: int | None = Field(
        None, ge=1, description="elastic runs: the fewest workers to keep training with"
    )
    max_workers: int | None = Field(
        None, ge=1, description="elastic runs: the most workers to grow to (default num_workers)"
    )
    use_gpu: bool | Literal["auto"] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_worker: float = Field(
        1.0, description="GPUs per worker when use_gpu: 1 (each worker drives one GPU)"
    )
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources each worker needs"
    )
    data_cpus: float = Field(1.0, ge=0.0, description="CPUs kept free for Ray Data tasks")
    accelerator_type: str | list[str] | None = Field(
        None, description="GPU type(s) workers may use, e.g. A100 or [A100, H100]"
    )
    capacity: Literal["any", "spot", "on_demand", "spot_first"] = Field(
        "any",
        description="which nodes workers may use (nodes carry a spot or on_demand resource); "
        "spot_first: spot while the run keeps to budget.deadline, on-demand added while it is "
        "behind (docs/cost.md)",
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels workers require, e.g. {zone: us-a}"
    )
    allow_mixed_accelerators: bool = Field(
        False, description="let one run's DDP group span several accelerator types"
    )
    balance: Literal["none", "auto"] | dict[str, float] = Field(
        "none",
        description="shares of the global batch: none (equal), auto (by measured speed) or "
        "weights by accelerator type, e.g. {A100: 3, L4: 1, default: 1}",
    )
    balance_tolerance: float = Field(
        0.15,
        gt=0.0,
        description="balance: auto re-plans at a checkpoint when the slowest rank's forward "
        "time per step exceeds the mean by more than this fraction (replica groups: a group "
        "declares a new speed when its measured one moved by more than this fraction)",
    )
    fault_tolerance: Literal["restart", "replicas"] = Field(
        "restart",
        description="restart: a lost node, spot notice or new capacity restarts the worker "
        "group from its last checkpoint; replicas: each worker is a replica group (torchft), "
        "the others go on stepping and a new group heals from a live peer (docs/elastic.md)",
    )
    resize_check_s: float = Field(
        60.0, gt=0.0, description="elastic runs: how often to look for room to grow"
    )
    ray_address: str | None = Field(None, description="cluster to join; None: start a local Ray")

    @field_validator("gpus_per_worker")
    @classmethod
    def _one_gpu_per_worker(cls, value: float) -> float:
        # A worker is one rank driving one device: with 0.5 two ranks share a GPU (NCCL
        # refuses: "Duplicate GPU detected"), with 2 the second GPU idles while the memory
        # estimate and MFU count one.
        if value != 1:
            raise ValueError(
                "each worker trains on exactly one GPU; for more GPUs use more workers "
                "(scaling.num_workers or scaling.max_workers)"
            )
        return value

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_setting(cls, value: Any) -> Any:
        if not isinstance(value, dict) and value not in ("none", "auto"):
            raise ValueError(
                "scaling.balance must be none, auto or weights by accelerator type such as "
                "{A100: 3, L4: 1}"
            )
        if isinstance(value, dict):
            if not value:
                raise ValueError("scaling.balance: give weights by type, or none or auto")
            bad = {
                k: w
                for k, w in value.items()
                if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf
            }
            if bad:
                raise ValueError(f"scaling.balance weights must be positive numbers: {bad}")
            upper = [str(k).upper() for k in value]
            if len(set(upper)) < len(upper):
                raise ValueError(f"scaling.balance names a type twice (case aside): {list(value)}")
        return value

    @model_validator(mode="after")
    def _elastic_bounds(self) -> ScalingConfig:
        if self.min_size > self.max_size:
            raise ValueError(
                f"scaling.min_workers ({self.min_size}) exceeds the most workers allowed "
                f"({self.max_size}, from scaling.max_workers or scaling.num_workers)"
            )
        return self

    @property
    def max_size(self) -> int:
        return self.max_workers or self.num_workers

    @property
    def min_size(self) -> int:
        return self.min_workers or self.max_size

    @property
    def elastic(self) -> bool:
        return self.min_size < self.max_size

    @property
    def world_sizes(self) -> range:
        return range(self.min_size, self.max_size + 1)
