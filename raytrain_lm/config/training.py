"""How each step is taken: the optimizer, the step loop and how the model is spread over the
workers. These are the sections the worker loop and `BatchPlan` read; none of them needs to
know how many workers there are or where they run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raytrain_lm.config.base import _Section


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0)
    min_lr: float = Field(1e-4, ge=0.0)
    warmup_steps: int = Field(50, ge=0)
    decay_steps: int | None = Field(
        None, ge=1, description="cosine decay length; max_steps if unset"
    )
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, ge=0.0, description="0 disables clipping")

    @model_validator(mode="after")
    def _min_below_peak(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")
        return self


class TrainingConfig(_Section):
    global_batch_size: int = Field(
        32, ge=1, description="sequences per optimizer step, all workers"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per worker per forward pass; unset: no accumulation"
    )
    max_steps: int = Field(1000, ge=1)
    stop_after_step: int | None = Field(
        None, ge=1, description="end this invocation after this step; the run resumes later"
    )
    eval_every: int = Field(200, ge=1)
    eval_sequences: int | None = Field(256, ge=1, description="val sequences per eval (None: all)")
    log_every: int = Field(10, ge=1)
    seed: int = 1337
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on GPUs that have it, fp32 elsewhere"
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model; auto: on CUDA, off on CPU"
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward instead of keeping them: full (every "
        "block) or selective (keep matmul and attention outputs, recompute the cheap rest)",
    )
    sample_prompt: str = "def "
    sample_tokens: int = Field(200, ge=0)
    progress: bool = True
    ledger: bool = Field(False, description="record the global sequence indices each worker used")


class ParallelConfig(_Section):
    """How the model is spread over the workers (trainer/distributed/parallel.py;
    docs/parallelism.md)."""

    strategy: Literal["ddp", "fsdp", "hsdp", "auto"] = Field(
        "ddp",
        description="ddp: a whole copy per worker; fsdp: weights, gradients and optimizer state "
        "sharded over all workers; hsdp: sharded inside groups of parallel.shard_size workers "
        "(one node's), replicated across groups; auto: the first of ddp, hsdp, fsdp whose "
        "state fits in a device",
    )
    shard_size: int | None = Field(
        None,
        ge=1,
        description="hsdp: workers (tensor-parallel groups) that share one copy of the state; "
        "unset: those of one node",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="llama: split each block's matmuls over this many workers of one node "
        "(with fsdp or hsdp over the rest)",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free gathered weights after forward (gather again for backward)"
    )
    sync: Literal["every_step", "diloco", "local_sgd"] = Field(
        "every_step",
        description="replica groups: average gradients every step, or rounds of "
        "diloco.sync_every steps for slow links between groups: DiLoCo (an outer optimizer "
        "steps on the averaged change of the weights) or LocalSGD (the weights averaged)",
    )
    auto_state_fraction: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="auto: share of a device that weights + gradients + AdamW may take under ddp",
    )

    @property
    def in_rounds(self) -> bool:
        """Whether replica groups train rounds alone between syncs (diloco, local_sgd), with
        the `diloco` section's settings, rather than syncing every step."""
        return self.sync != "every_step"
