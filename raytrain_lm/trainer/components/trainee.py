"""What a worker trains: the model as built and placed (layout: DDP, FSDP, HSDP, tensor
parallel), its optimizer, the batch plan, and the step parts built from them. Built from the
`model`, `parallel`, `optim` and `training` settings and the group's size; the same on every
rank of a group (choosing the layout is a collective over it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytrain_lm import devices
from raytrain_lm.config import BALANCE_AUTO_UNDER_FSDP, RunConfig
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model
from raytrain_lm.tokenization import load_tokenizer
from raytrain_lm.trainer.components.balance import ForwardClock, type_weights
from raytrain_lm.trainer.components.batch_plan import BatchPlan, learning_rate
from raytrain_lm.trainer.components.step import StepParts
from raytrain_lm.trainer.distributed.collectives import all_reduce
from raytrain_lm.trainer.distributed.mesh import Layout
from raytrain_lm.trainer.distributed.parallel import (
    apply_layout,
    choose_layout,
    device_memory_bytes,
    replicate_model,
)
from raytrain_lm.trainer.progress import announce


@dataclass(frozen=True)
class Where:
    """This process in its training process group, and what the group may hold."""

    rank: int
    world: int
    chief: bool  # the process that announces
    node_ids: list[str]  # every rank's node (a collective), in rank order
    device_bytes: int  # the smallest device's memory (a collective)
    types: list[str]  # every rank's accelerator type (a collective), in rank order


class Trainee:
    def __init__(self, cfg: RunConfig, data_dir: str, device: torch.device, where: Where,
                 checkpoint_strategy: str | None):  # fmt: skip
        self.cfg, self.device, self.where = cfg, device, where
        devices.configure_device(device)
        self.bf16 = devices.use_bf16(device, cfg.training.precision)
        self.compile = devices.use_compile(device, cfg.training.compile)
        self.manifest = Manifest.load(data_dir)
        self.tokenizer_json = load_tokenizer(data_dir).to_json()
        torch.manual_seed(cfg.training.seed)
        self.model = build_model(cfg.model, self.manifest.vocab_size).to(device)
        if cfg.model.init_from:  # a restore replaces these weights when resuming
            from raytrain_lm.huggingface import load_hf_weights

            load_hf_weights(self.model, cfg.model.init_from)
        self.layout = self._choose_layout(checkpoint_strategy)
        apply_layout(
            self.model, self.layout, device, self.bf16, cfg.parallel.reshard_after_forward,
            self.compile, cfg.training.activation_checkpointing,
        )  # fmt: skip
        # A tensor-parallel group reads the same sequences: data is split over the groups.
        self.data_rank = self.layout.data_rank(where.rank)
        self.data_world = self.layout.data_world
        self.optimizer = devices.build_adamw(
            self.model.optimizer_groups(cfg.optim.weight_decay),
            cfg.optim.lr,
            (cfg.optim.beta1, cfg.optim.beta2),
            device,
        )
        self.clock = ForwardClock(device) if cfg.scaling.balance == "auto" else None
        self.plan = self._initial_plan()
        self.flops_per_token = self.model.flops_per_token()
        self.tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
        self.decay_steps = cfg.optim.decay_steps or cfg.training.max_steps

    def lr(self, step: int) -> float:
        optim = self.cfg.optim
        return learning_rate(step, optim.lr, optim.min_lr, optim.warmup_steps, self.decay_steps)

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def sharded(self) -> bool:
        return self.strategy != "ddp"

    def step_parts(self, plan: BatchPlan | None = None, rank: int | None = None) -> StepParts:
        """The model as it steps: DDP-wrapped (and compiled around DDP, so that gradient
        buckets overlap the backward) unless sharded, where it is compiled per block and wrapped
        in place already."""
        model = self.model
        if not self.sharded:
            model = replicate_model(model, self.device, self.where.world)
            if self.compile:
                model = torch.compile(model)
        return StepParts(
            model, self.model, self.optimizer, plan or self.plan,
            self.data_rank if rank is None else rank, self.device, self.bf16,
            self.cfg.optim.grad_clip, clock=self.clock,
        )  # fmt: skip

    def _choose_layout(self, previous: str | None) -> Layout:
        """parallel.strategy, with `auto` settled from the memory the group's state needs
        against its smallest device, and where each rank sits in the mesh (mesh.py)."""
        setting, where = self.cfg.parallel.strategy, self.where
        params = self.model.num_params(non_embedding=False)
        layout, estimate = choose_layout(
            self.cfg.parallel, where.node_ids, params, where.device_bytes, previous
        )
        if setting != "ddp":
            how = "resumed as checkpointed" if previous else "chosen"
            announce(
                f"parallel.strategy={layout.strategy}"
                + (f" ({how} by auto)" if setting == "auto" else "")
                + f", {layout.describe()}: {estimate.describe()}",
                where.chief,
            )
        return layout

    def _initial_plan(self) -> BatchPlan:
        """Equal shares, or shares by type weights (`scaling.balance`); `auto` starts equal
        and re-plans once it has measured (components/rebalancing.py)."""
        setting, training, world = self.cfg.scaling.balance, self.cfg.training, self.where.world
        if setting == "none":
            return BatchPlan.derive(training, self.data_world)
        if setting == "auto" and self.sharded:  # strategy auto chose FSDP in the workers
            raise UserError(BALANCE_AUTO_UNDER_FSDP)
        weights = [1.0] * world if setting == "auto" else type_weights(setting, self.where.types)
        return BatchPlan.derive(training, world, weights, same_passes=self.sharded)


def where_in_group(ray, rank: int, world: int, device: torch.device, chief: bool,
                   needs_nodes: bool) -> Where:  # fmt: skip
    """This rank's place and what its group holds, gathered over the group (collectives: every
    rank calls it at the same point). Under ddp no mesh is built: nodes do not matter."""
    nodes = ray.node_ids(world) if needs_nodes else ["any"] * world
    (device_bytes,) = all_reduce([device_memory_bytes(device, ray.local_world_size)], device, "min")
    return Where(rank, world, chief, nodes, int(device_bytes), ray.accelerator_types(world, device))
