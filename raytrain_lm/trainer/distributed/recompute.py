"""Activation checkpointing: recomputing a block's activations in backward instead of keeping
them from forward, applied to a model's blocks from outside (the model knows nothing of it).

`full` keeps only each block's input: the least memory, one more forward of every block.
`selective` keeps what is expensive to recompute (matmul and attention outputs) and recomputes
the cheap rest (norms, activation functions, RoPE, dropout), as torchtitan's op-level policy
does. Both give the same loss and gradients as `none`: dropout is replayed with the same random
state. State dict names are unchanged, so checkpoints move freely between the settings.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from raytrain_lm.causal_lm import CausalLM

_aten = torch.ops.aten
# Outputs worth keeping: recomputing them costs a matmul or an attention each.
_EXPENSIVE = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: CausalLM, mode: str) -> None:
    """Wraps each of `model.blocks` in place; `mode` is none, full or selective."""
    if mode == "none":
        return
    options: dict = {"use_reentrant": False, "preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _keep_expensive
        )
        _quiet_compiled_policy_warning()
    elif mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r}")
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_fn=checkpoint, **options)


class _CompiledPolicyWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _quiet_compiled_policy_warning() -> None:
    """Compiling a block with a selective policy makes torch warn, once per compiled block,
    that the region must not hold in-place ops. Ours hold none (model.py, llama.py; the
    recompute tests check every setting's gradients against `none`), so the four-line warning
    only alarms; it alone is dropped, not the logger's other messages."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _CompiledPolicyWarning) for f in logger.filters):
        logger.addFilter(_CompiledPolicyWarning())
