"""The whole tree. Checks that span sections (a global batch that every allowed world size can
split, balancing against the parallel strategy) can only live here, as can `resolved`, which
pins every path of every section on the driver.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from raytrain_lm.config.base import RUN_NAME_PATTERN, _Section, check_storage_location
from raytrain_lm.config.budget import BudgetConfig
from raytrain_lm.config.data import DataConfig
from raytrain_lm.config.fault import CheckpointConfig, FaultConfig
from raytrain_lm.config.model import ModelConfig
from raytrain_lm.config.replicas import DilocoConfig, ReplicasConfig
from raytrain_lm.config.scaling import ScalingConfig
from raytrain_lm.config.tracking import TrackingConfig
from raytrain_lm.config.training import OptimConfig, ParallelConfig, TrainingConfig

BALANCE_AUTO_UNDER_FSDP = (
    "scaling.balance=auto times each rank's forward passes, which under FSDP wait on the "
    "other ranks' all-gathers; use parallel.strategy=ddp, or weights by type such as "
    "scaling.balance={A100: 3, L4: 1}"
)


class RunConfig(_Section):
    name: str = Field("demo", pattern=RUN_NAME_PATTERN)
    output_dir: str = Field("runs", description="where runs go (a path or a bucket URI)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)

    def resolved(self, base_dir: str | Path | None = None) -> RunConfig:
        """A copy in which every local path is absolute, taken relative to `base_dir` (default:
        the working directory), and `tracking.uri` names the store the run will use (see
        `TrackingConfig.store_uri`). URIs (`s3://...`) and `builtin:` corpora are kept as given.

        Ray Train workers, Tune trials and job drivers run in working directories of their own
        (under Ray's session folder): resolving once, on the driver, makes them all read and
        write the files the user named, and never consult the environment for the store."""
        from raytrain_lm.storage import is_uri  # pyarrow: too heavy for every import

        base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())

        def absolute(path: str) -> str:
            if path.startswith("file://"):
                path = path.removeprefix("file://")
            if is_uri(path) or path.startswith("builtin:"):
                return path
            return os.path.normpath(os.path.join(base, os.path.expanduser(path)))

        cfg = self.model_copy(deep=True)
        cfg.output_dir = absolute(cfg.output_dir)
        data = cfg.data
        data.sources = [absolute(source) for source in data.sources]
        data.cache_dir = absolute(data.cache_dir)
        if data.prepared:
            data.prepared = absolute(data.prepared)
        if data.tokenizer.path:
            data.tokenizer.path = absolute(data.tokenizer.path)
        if cfg.model.init_from:
            cfg.model.init_from = absolute(cfg.model.init_from)
        if cfg.tracking.enabled:
            cfg.tracking.uri = cfg.tracking.store_uri(base)
        return cfg

    @field_validator("output_dir")
    @classmethod
    def _output_location(cls, value: str) -> str:
        return check_storage_location(value)

    @model_validator(mode="after")
    def _batch_fits_workers(self) -> RunConfig:
        self._parallel_fits()
        self._budget_fits()
        if self.scaling.fault_tolerance == "replicas":
            self._replicas_fit()
            return self
        if self.parallel.in_rounds:
            raise ValueError(
                f"parallel.sync={self.parallel.sync} syncs replica groups: set "
                "scaling.fault_tolerance=replicas"
            )
        if self.scaling.balance != "none":
            self._balanced_shares_fit()
            return self
        self._batch_splits_at_every_world_size()
        return self

    def _budget_fits(self) -> None:
        """A dollar budget needs prices to count against; spot_first keeps to a deadline by
        adding on-demand nodes, so it needs both the deadline and room to grow."""
        if self.budget.max_usd is not None and not self.fault.price_per_hour:
            raise ValueError(
                "budget.max_usd counts fault.price_per_hour: set it, e.g. {A100: 1.3, cpu: 0.1}"
            )
        if self.scaling.capacity == "spot_first":
            if self.budget.deadline is None:
                raise ValueError(
                    "scaling.capacity=spot_first keeps to budget.deadline: set it, e.g. 36h"
                )
            if self.scaling.min_size >= self.scaling.max_size:
                raise ValueError(
                    "scaling.capacity=spot_first adds on-demand nodes for workers a run may "
                    "grow to: set scaling.min_workers below scaling.max_workers"
                )

    def _balanced_shares_fit(self) -> None:
        """Balanced shares are uneven anyway: one sequence per rank is all they need."""
        if self.training.global_batch_size < self.scaling.max_size:
            raise ValueError(
                f"training.global_batch_size ({self.training.global_batch_size}) gives "
                f"fewer than one sequence to each of up to {self.scaling.max_size} workers"
            )
        if self.scaling.balance == "auto" and self.parallel.strategy in ("fsdp", "hsdp"):
            raise ValueError(BALANCE_AUTO_UNDER_FSDP)

    def _batch_splits_at_every_world_size(self) -> None:
        """The global batch never changes with the world size, so it must split evenly at
        every size an elastic run may take: refused up front, not at the first resize."""
        micro = self.training.micro_batch_size
        for world in self.scaling.world_sizes:
            if not self.batch_splits_over(world):
                if self.scaling.elastic:
                    what = (
                        f"world size {world} (the run may use {self.scaling.min_size} to "
                        f"{self.scaling.max_size} workers)"
                    )
                else:
                    what = f"scaling.num_workers ({world})"
                if micro:
                    what += f" x training.micro_batch_size ({micro})"
                raise ValueError(
                    f"training.global_batch_size ({self.training.global_batch_size}) "
                    f"is not divisible by {what}"
                )

    def batch_splits_over(self, workers: int) -> bool:
        """Whether the global batch splits over `workers` as the run splits it: into whole
        micro-batches per data-parallel rank, or, in shares by speed (`scaling.balance`) or
        over replica groups, into one sequence at least each. What `raytrain-lm plan` offers
        too: only worker counts a run of this config can train with."""
        batch = self.training.global_batch_size
        if self.scaling.balance != "none" or self.scaling.fault_tolerance == "replicas":
            return batch >= workers
        tp = self.parallel.tensor_parallel
        micro = self.training.micro_batch_size or 1
        return workers % tp == 0 and batch % (workers // tp * micro) == 0

    def _parallel_fits(self) -> None:
        """Tensor parallelism and hsdp's shard groups need every world size the run may take
        to split into whole groups; the tensor-parallel plan is llama's."""
        parallel, tp = self.parallel, self.parallel.tensor_parallel
        if parallel.shard_size is not None and parallel.strategy not in ("hsdp", "auto"):
            raise ValueError(
                f"parallel.shard_size applies to parallel.strategy=hsdp, not {parallel.strategy}"
            )
        group = tp * (parallel.shard_size or 1)
        if tp > 1:
            if self.model.arch != "llama":
                raise ValueError("parallel.tensor_parallel needs model.arch=llama")
            if parallel.strategy not in ("fsdp", "hsdp"):
                raise ValueError(
                    "parallel.tensor_parallel composes with parallel.strategy=fsdp or hsdp, "
                    f"not {parallel.strategy}"
                )
            if self.scaling.balance != "none":
                raise ValueError("scaling.balance splits batches by rank: not with tensor_parallel")
            model = self.model
            for what, n in (
                ("model.n_head", model.n_head),
                ("model.n_kv_head", model.n_kv_head or model.n_head),
                ("model.block_size", model.block_size),
            ):
                if n % tp:
                    raise ValueError(f"parallel.tensor_parallel={tp} does not divide {what} ({n})")
        uneven = [w for w in self.scaling.world_sizes if w % group]
        if uneven:
            raise ValueError(
                f"scaling allows {uneven[0]} workers, which do not split into groups of "
                f"{group} (parallel.tensor_parallel x shard_size): every worker count the "
                f"run may take must be a multiple of {group}"
            )

    def _replicas_fit(self) -> None:
        """Replica groups split each step over whoever takes part (any count from min_workers
        to max_workers, evenly or not), each holding the whole model."""
        if self.scaling.capacity == "spot_first":
            raise ValueError(
                "scaling.capacity=spot_first moves one worker group between spot and "
                "on-demand nodes; replica groups cannot yet: use scaling.capacity=spot or any"
            )
        if self.training.global_batch_size < self.scaling.max_size:
            raise ValueError(
                f"training.global_batch_size ({self.training.global_batch_size}) gives fewer "
                f"than one sequence to each of up to {self.scaling.max_size} replica groups"
            )
        if self.parallel.strategy in ("fsdp", "hsdp"):
            raise ValueError(
                "scaling.fault_tolerance=replicas keeps a whole model in every group: use "
                "parallel.strategy=ddp (sharding inside a group comes with hybrid sharding)"
            )
        if self.parallel.in_rounds:
            self._rounds_fit()

    def _rounds_fit(self) -> None:
        diloco = self.diloco
        if self.checkpoint.every_steps == "auto":
            raise ValueError(
                "checkpoint.every_steps=auto agrees the interval in a step's sums; with "
                f"parallel.sync={self.parallel.sync} give a number of steps"
            )
        if self.parallel.sync == "local_sgd" and (diloco.fragments > 1 or diloco.quantize):
            raise ValueError(
                "parallel.sync=local_sgd averages the whole model at each round's end: "
                "diloco.fragments and diloco.quantize are DiLoCo's (parallel.sync=diloco)"
            )
        if diloco.fragments > 1 and diloco.sync_every % diloco.fragments:
            raise ValueError(
                f"diloco.fragments={diloco.fragments} sync in turn, one every "
                f"diloco.sync_every/fragments steps: make sync_every ({diloco.sync_every}) a "
                "multiple of fragments"
            )
        if diloco.fragments > 1 and diloco.full_sync_every < 2:
            raise ValueError(
                "diloco.full_sync_every=1 syncs every fragment at once at every round's end, "
                "which is plain DiLoCo: set it to 2 or more, or diloco.fragments=1"
            )
        if self.scaling.balance != "none":
            raise ValueError(
                "scaling.balance splits every step by the groups' types or speeds; with "
                f"parallel.sync={self.parallel.sync} each group's share is set for a whole "
                "round: use none"
            )
