"""Learning parity with nanoGPT's CPU "baby GPT" recipe.

Runs nanoGPT's recipe twice on the same character-level text and the same train/val split:
once as a plain nanoGPT-style single-process loop (benchmarks/nanogpt_reference.py), once as
`raytrain-lm train experiments/nanogpt_cpu_baby.yaml` (2 Ray Train DDP workers, Ray Data
streaming). Both final models are scored on the same full validation split.

    .venv/bin/python benchmarks/parity_nanogpt.py                   # English prose that ships with Python
    .venv/bin/python benchmarks/parity_nanogpt.py --text input.txt  # e.g. tiny-shakespeare
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from nanogpt_reference import Recipe, train_reference

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.data.manifest import read_shard
from raytrain_lm.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]


def split_tokens(prepared, split: str) -> np.ndarray:
    shards = prepared.manifest.splits[split].shards
    return np.concatenate([read_shard(prepared.directory, s) for s in shards])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", help="text file to train on (default: builtin:python-docs)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workdir", default="benchmarks/results/parity")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()

    work = Path(args.workdir).resolve()
    overrides = [
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"name=parity-{int(time.time())}",
        f"training.max_steps={args.steps}",
        f"optim.decay_steps={args.steps}",
        "training.sample_tokens=0",
        *args.set,
    ]
    if args.text:
        overrides.append(f"data.sources={args.text}")
    cfg = load_config(ROOT / "experiments" / "nanogpt_cpu_baby.yaml", overrides)
    prepared = prepare(cfg.data)
    train, val = split_tokens(prepared, "train"), split_tokens(prepared, "val")
    recipe = Recipe(max_iters=args.steps, lr_decay_iters=args.steps)
    print(
        f"text: {cfg.data.sources}; {len(train):,} train / {len(val):,} val characters; "
        f"vocab {prepared.manifest.vocab_size}"
    )

    t0 = time.perf_counter()
    reference = train_reference(train, val, prepared.manifest.vocab_size, recipe, log_every=1)
    reference_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = raytrain_lm.train(cfg, sample=False)
    ours_s = time.perf_counter() - t0

    result = {
        "text": cfg.data.sources,
        "steps": args.steps,
        "nanogpt_style_full_val_loss": reference["full_val_loss"],
        "nanogpt_style_estimated_val_loss": reference["estimated_val_loss"],
        "raytrain_lm_val_loss": ours["val_loss"],
        "difference": ours["val_loss"] - reference["full_val_loss"],
        "nanogpt_style_wall_s": round(reference_s, 1),
        "raytrain_lm_wall_s": round(ours_s, 1),
    }
    (work / "parity.json").write_text(json.dumps(result, indent=2))
    print("parity: " + json.dumps(result))


if __name__ == "__main__":
    main()
