"""Tensor parallelism inside a node for `model.arch=llama`, applied from outside the model with
torchtitan's plan (Megatron-style, with sequence parallelism):

- q, k, v and the MLP's gate and up projections are split by columns (each rank computes its
  own heads and its own slice of the hidden width); o and down are split by rows, and their
  partial sums are reduce-scattered along the sequence;
- between blocks the activations stay split along the sequence (dim 1), so the RMSNorms run on
  1/N of the tokens each (`SequenceParallel`) and are gathered only at the next block's input;
- the embedding is split by rows of the vocabulary and hands on sequence-split activations;
  the output head is split by columns (the vocabulary) and its logits are gathered whole, so
  the loss is the model's own (torchtitan can instead keep them split for a parallel loss).

Two all-gathers and two reduce-scatters per block and step, all over the tensor-parallel group,
which is why that group never leaves a node. Runs on gloo on CPU as well as on NCCL.
"""

from __future__ import annotations

import torch

from raytrain_lm.errors import UserError


def check_divides(shape, tensor_parallel: int) -> None:
    """The heads, the MLP width and the sequence must split evenly over the group."""
    n_kv = shape.n_kv_head
    for what, n in (
        ("model.n_head", shape.n_head),
        ("model.n_kv_head", n_kv),
        ("the MLP width", shape.ffn_hidden),
        ("model.block_size", shape.block_size),
    ):
        if n % tensor_parallel:
            raise UserError(
                f"parallel.tensor_parallel={tensor_parallel} does not divide {what} ({n})"
            )


def block_plan() -> dict:
    """How one `LlamaBlock`'s modules are split (parallelize_module's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "input_layernorm": SequenceParallel(),
        # (x, cos, sin): only x is distributed; the RoPE tables are the same everywhere
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """Parallelizes a `Llama` in place over the 1-D tensor-parallel `mesh`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_divides(model.shape, mesh.size())
    tied = model.lm_head.weight is model.embed_tokens.weight
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, root)
    for block in model.layers:
        parallelize_module(block, mesh, block_plan())
    if tied:  # both are split by vocabulary rows; parallelizing made them two parameters
        model.lm_head.weight = model.embed_tokens.weight
