"""A plain single-process training loop written the way nanoGPT's train.py is: random-offset
batches from an in-memory token array, get_lr warmup + cosine, AdamW with nanoGPT's
weight-decay groups, gradient clipping, estimate_loss on random batches. No Ray, no DDP.

It is the baseline for two comparisons: learning parity (benchmarks/parity_nanogpt.py) and the
single-worker overhead of our Ray Train loop (benchmarks/ddp_overhead.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from raytrain_lm.model import GPT, GPTShape


@dataclass
class Recipe:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12
    max_iters: int = 2000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    dropout: float = 0.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 1337


def get_lr(it: int, r: Recipe) -> float:
    if it < r.warmup_iters:
        return r.learning_rate * (it + 1) / (r.warmup_iters + 1)
    if it > r.lr_decay_iters:
        return r.min_lr
    ratio = (it - r.warmup_iters) / (r.lr_decay_iters - r.warmup_iters)
    return r.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (r.learning_rate - r.min_lr)


def full_val_loss(model: GPT, val: np.ndarray, block: int, batch: int = 64) -> float:
    """Mean loss over consecutive non-overlapping windows of the whole validation split
    (the same fixed set raytrain-lm evaluates)."""
    starts = np.arange(0, len(val) - block - 1 + 1, block)[: (len(val) - 1) // block]
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            s = starts[i : i + batch]
            x = torch.stack([torch.from_numpy(val[j : j + block].astype(np.int64)) for j in s])
            y = torch.stack(
                [torch.from_numpy(val[j + 1 : j + 1 + block].astype(np.int64)) for j in s]
            )
            _, loss = model(x, y)
            total += loss.item() * len(s)
            count += len(s)
    model.train()
    return total / count


def train_reference(
    train: np.ndarray, val: np.ndarray, vocab_size: int, r: Recipe, log_every: int = 0
) -> dict:
    torch.manual_seed(r.seed)
    train_t = torch.from_numpy(train.astype(np.int64))
    val_t = torch.from_numpy(val.astype(np.int64))

    def get_batch(split):
        data = train_t if split == "train" else val_t
        ix = torch.randint(len(data) - r.block_size, (r.batch_size,))
        x = torch.stack([data[i : i + r.block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + r.block_size] for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(r.eval_iters)
            for k in range(r.eval_iters):
                _, loss = model(*get_batch(split))
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    model = GPT(GPTShape(vocab_size, r.block_size, r.n_layer, r.n_head, r.n_embd, r.dropout, False))
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(r.weight_decay), lr=r.learning_rate, betas=(r.beta1, r.beta2)
    )
    history, step_times = [], []
    X, Y = get_batch("train")
    iter_num = 0
    while True:
        lr = get_lr(iter_num, r)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if r.eval_interval and iter_num % r.eval_interval == 0:
            losses = estimate_loss()
            history.append({"iter": iter_num, **losses})
            if log_every:
                print(
                    f"reference step {iter_num}: train {losses['train']:.4f}, val {losses['val']:.4f}"
                )
        if iter_num == r.max_iters:
            break  # nanoGPT evaluates at max_iters after max_iters optimizer steps
        t0 = time.perf_counter()
        _, loss = model(X, Y)
        X, Y = get_batch("train")
        loss.backward()
        if r.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        iter_num += 1
    steady = step_times[3:] or step_times
    return {
        "history": history,
        "estimated_val_loss": history[-1]["val"] if history else None,
        "full_val_loss": full_val_loss(model, val, r.block_size),
        "tokens_per_s": r.batch_size * r.block_size * len(steady) / sum(steady),
    }
