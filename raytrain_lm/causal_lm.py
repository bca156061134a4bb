"""What every architecture here shares: a decoder-only language model over token ids.

`GPT` (model.py) and `Llama` (llama.py) subclass `CausalLM`; the training loop, `generate` and
the checkpoint code see only this interface. Pure PyTorch, like the architectures.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalLM(nn.Module):
    """`forward(idx, targets)` -> (logits, loss); subclasses set `shape` (n_layer, n_head,
    n_embd, block_size) and `lm_head`, and give `blocks`, the transformer blocks that
    sharding and activation recomputation wrap."""

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def num_params(self, non_embedding: bool = True) -> int:
        """All parameters; with `non_embedding`, only those that cost a multiply per token
        (a lookup table does not, an output projection tied to it does)."""
        raise NotImplementedError

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T."""
        s = self.shape
        return 6 * self.num_params() + attention_flops_per_token(
            s.n_layer, s.n_head, s.n_embd // s.n_head, s.block_size
        )

    def logits_and_loss(
        self, x: torch.Tensor, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection of the last hidden states x (B, T, C), and the loss against
        targets (B, T); without targets (sampling) only the last position is projected."""
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, vocab)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices and embeddings; never biases or norm gains (as nanoGPT)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Autoregressive sampling; idx is (B, T) token ids, returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def attention_flops_per_token(n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """Forward + backward FLOPs per token of QK^T and AV at full context (PaLM, appendix B)."""
    return 12 * n_layer * n_head * head_dim * seq_len
