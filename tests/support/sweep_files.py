"""Sweep files for tests: the tiny test model's sweeps, written as a user would write them."""

from __future__ import annotations

from pathlib import Path

import yaml

from raytrain_lm.config import parse_override, set_dotted


def overrides_tree(overrides: list[str]) -> dict:
    tree: dict = {}
    for text in overrides:
        keys, value = parse_override(text)
        set_dotted(tree, keys, value)
    return tree


def write_sweep(folder: Path, overrides: list[str], **top) -> Path:
    """A sweep over the tiny test model: 1 worker per trial, a report at every 2 steps."""
    config = overrides_tree(
        [
            "scaling.num_workers=1",
            "training.max_steps=6",
            "training.eval_every=2",
            "checkpoint.every_steps=2",
            "fault.max_failures=2",
            *overrides,  # a test's own settings win
        ]
    )
    spec = {
        "config": config,
        "space": {"optim.lr": {"loguniform": [1e-3, 1e-2]}, "model.n_embd": {"choice": [32, 48]}},
        "max_concurrent_trials": 2,
        **top,
    }
    path = folder / f"{top.get('name', 'sweep')}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
