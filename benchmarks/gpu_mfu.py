"""MFU of GPT-2 124M on one GPU: bf16 autocast, torch.compile, fused AdamW, flash attention
(SDPA), TF32 — the CUDA path of raytrain-lm's training step, without Ray around it.

    PYTHONPATH=. python benchmarks/gpu_mfu.py            # on a machine with a GPU
    PYTHONPATH=. python benchmarks/gpu_mfu.py --steps 5 --n-layer 2 --n-embd 128  # CPU smoke test

Needs only torch. Anchors: 45-55% MFU for models of this size on A100/H100.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.trainer import hardware


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)  # GPT-2's 50257, padded to 64
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hardware.configure_device(device)
    bf16 = hardware.use_bf16(device, "auto")
    torch.manual_seed(0)
    shape = GPTShape(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    raw = GPT(shape).to(device)
    optimizer = hardware.build_adamw(raw.optimizer_groups(0.1), 6e-4, (0.9, 0.95), device)
    model = raw if args.no_compile or device.type != "cuda" else torch.compile(raw)
    data = torch.randint(0, args.vocab_size, (args.micro_batch, args.block_size + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    times = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.accumulation):
            with hardware.autocast(device, bf16):
                _, loss = model(x, y)
            (loss / args.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    tokens_per_step = args.micro_batch * args.accumulation * args.block_size
    tokens_per_s = tokens_per_step * len(times) / sum(times)
    flops = raw.flops_per_token() * tokens_per_s
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params_M": round(raw.num_params() / 1e6, 1),
        "bf16": bf16,
        "compiled": model is not raw,
        "flash_sdpa": device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled(),
        "tokens_per_s": round(tokens_per_s),
        "achieved_tflops": round(flops / 1e12, 2),
        "peak_tflops": hardware.peak_flops(device) / 1e12,
        "mfu": round(flops / hardware.peak_flops(device), 4),
        "loss": round(loss.detach().item(), 4),
    }
    print("gpu_mfu: " + json.dumps(result))


if __name__ == "__main__":
    main()
