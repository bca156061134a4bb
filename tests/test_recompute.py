"""Activation checkpointing (trainer/distributed/recompute.py): same loss and gradients, less memory."""

from __future__ import annotations

import pytest
import torch

from raytrain_lm.llama import Llama, LlamaShape
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.trainer.distributed.recompute import apply_activation_checkpointing

MODES = ("none", "full", "selective")
ARCHS = {
    # dropout: recomputation must replay the same masks
    "gpt2": lambda: GPT(GPTShape(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32,
                                 dropout=0.1)),
    "llama": lambda: Llama(LlamaShape(vocab_size=64, block_size=32, n_layer=3, n_head=4,
                                      n_kv_head=2, n_embd=32, ffn_hidden=96)),
}  # fmt: skip


def _loss_and_grads(arch: str, mode: str) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = ARCHS[arch]()
    apply_activation_checkpointing(model, mode)
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in
             model.named_parameters()}  # fmt: skip
    return loss.item(), grads, list(model.state_dict())


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputation_gives_the_same_loss_gradients_and_state_names(arch):
    loss, grads, names = _loss_and_grads(arch, "none")
    for mode in ("full", "selective"):
        other_loss, other_grads, other_names = _loss_and_grads(arch, mode)
        assert other_loss == loss and other_names == names, mode
        for name, grad in grads.items():
            assert torch.allclose(other_grads[name], grad, atol=1e-7), (mode, name)


def test_a_state_saved_without_recomputation_loads_with_it():
    torch.manual_seed(0)
    plain = ARCHS["llama"]()
    wrapped = ARCHS["llama"]()
    apply_activation_checkpointing(wrapped, "full")
    wrapped.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(plain.eval()(idx, idx)[0], wrapped.eval()(idx, idx)[0])


def _bytes_held_after_forward(mode: str) -> tuple[int, float]:
    """Bytes allocated by a forward pass and not freed by its end: the activations kept for
    backward (plus the logits), which is where training's memory peaks. Counted by PyTorch's
    profiler from the allocator's own events, after a warm-up step has made gradients."""
    torch.manual_seed(0)
    model = Llama(LlamaShape(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_kv_head=2,
                             n_embd=128, ffn_hidden=352))  # fmt: skip
    apply_activation_checkpointing(model, mode)
    idx = torch.randint(0, 256, (8, 129))
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    model(inputs, targets)[1].backward()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        _, loss = model(inputs, targets)
    return sum(e.self_cpu_memory_usage for e in profile.key_averages()), loss.item()


def test_recomputation_lowers_peak_activation_memory():
    """Measured on a llama of 8 blocks, 8 sequences of 128 tokens: on this machine none keeps
    88 MB, selective 52 MB, full 8 MB."""
    held = {mode: _bytes_held_after_forward(mode) for mode in MODES}
    assert len({loss for _, loss in held.values()}) == 1, held
    none, full, selective = (held[m][0] for m in MODES)
    assert full < 0.2 * none and selective < 0.7 * none and full < selective, held
