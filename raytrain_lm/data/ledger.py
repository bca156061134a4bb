"""The consumption ledger: which global sequence positions were trained on, for audits.

Each worker writes, at every checkpoint, the positions it consumed since the previous one
(`ledger/steps-<from>-<to>-rank<r>.npy`). Work after the last checkpoint is redone on restart,
so a restart from step k first discards every file whose interval starts at or after k.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_NAME = re.compile(r"steps-(\d+)-(\d+)-rank(\d+)\.npy")


def discard_after(run_dir: str | Path, step: int) -> None:
    for file in (Path(run_dir) / "ledger").glob("steps-*.npy"):
        match = _NAME.fullmatch(file.name)
        if match and int(match.group(1)) >= step:
            file.unlink()


def read_ledger(run_dir: str | Path) -> np.ndarray:
    """Every position recorded, all ranks and intervals, sorted (a multiset)."""
    files = sorted((Path(run_dir) / "ledger").glob("steps-*.npy"))
    if not files:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate([np.load(f) for f in files]))
