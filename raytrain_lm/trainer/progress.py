"""A console progress bar for rank 0: one self-contained line per update, because Ray
forwards worker output line by line (carriage-return bars interleave badly across processes)."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60:02d}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds / 3600:.1f}h"


class ProgressBar:
    def __init__(self, total: int, start: int, every: int, width: int = 24):
        self.total, self.start, self.every, self.width = total, start, every, width
        self.began = time.perf_counter()

    def update(self, step: int, metrics: dict[str, float], force: bool = False) -> None:
        if not (force or step % self.every == 0 or step == self.total):
            return
        done = step / max(self.total, 1)
        filled = int(done * self.width)
        elapsed = time.perf_counter() - self.began
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        parts = [
            f"[{'█' * filled}{'·' * (self.width - filled)}] {step}/{self.total}",
            f"loss {metrics['train/loss']:.4f}",
        ]
        if "val/loss" in metrics:
            parts.append(f"val {metrics['val/loss']:.4f}")
        parts += [
            f"{metrics['perf/tokens_per_s'] / 1e3:.1f}k tok/s",
            # Three significant digits: a CPU's MFU (under 0.1 %) read "0.0%" at one decimal.
            f"MFU {100 * metrics['perf/mfu']:.3g}%",
        ]
        if "cost/spent" in metrics:  # with budget.* set
            parts.append(f"${metrics['cost/spent']:,.2f} of ~${metrics['cost/projected']:,.2f}")
        parts.append(f"{_duration(elapsed)}<{_duration(eta)}")
        # The real stdout: Ray Train's patched print would echo the line twice once another
        # library (MLflow) has wrapped sys.stdout.
        print(" | ".join(parts), file=sys.__stdout__, flush=True)


def announce(message: str, chief: bool = True) -> None:
    # The real stdout: Ray Train's patched print would echo a line twice once another library
    # (MLflow) has wrapped sys.stdout.
    if chief:
        print(f"[raytrain-lm] {message}", file=sys.__stdout__, flush=True)
