"""The consumption ledger: which global sequence positions were trained on, for audits.

Each worker writes, at every checkpoint, the positions it consumed since the previous one
(`ledger/steps-<from>-<to>-rank<r>.npy` in the run directory, local or in a bucket: one object
per rank and interval, so no two writers share one). Work after the last checkpoint is redone
on restart, so a restart from step k first discards every file whose interval starts at or
after k.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from raytrain_lm.rundir import LEDGER_DIR, RunDir

_NAME = re.compile(r"steps-(\d+)-(\d+)-rank(\d+)\.npy")


def record(run_dir: RunDir, first_step: int, last_step: int, rank: int, positions) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(positions, dtype=np.int64))
    name = f"steps-{first_step:09d}-{last_step:09d}-rank{rank}.npy"
    run_dir.write_bytes(buffer.getvalue(), LEDGER_DIR, name)


def discard_after(run_dir: RunDir | str | Path, step: int) -> None:
    run_dir = RunDir.coerce(run_dir)
    for name in run_dir.list_files(LEDGER_DIR):
        match = _NAME.fullmatch(name)
        if match and int(match.group(1)) >= step:
            run_dir.delete(LEDGER_DIR, name)


def read_ledger(run_dir: RunDir | str | Path) -> np.ndarray:
    """Every position recorded, all ranks and intervals, sorted (a multiset)."""
    run_dir = RunDir.coerce(run_dir)
    arrays = [
        np.load(io.BytesIO(run_dir.read_bytes(LEDGER_DIR, name)))
        for name in run_dir.list_files(LEDGER_DIR)
        if _NAME.fullmatch(name)
    ]
    return np.sort(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=np.int64)
