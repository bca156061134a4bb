"""Durations as people write them: `36h`, `2d`, `90m`, or a bare number of hours."""

from __future__ import annotations

import re


def parse_duration_h(text: str | float | None) -> float | None:
    """Hours; ValueError (a UserError's message) for anything else."""
    if text is None or isinstance(text, int | float):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([dhm]?)\s*", str(text))
    if not match:
        raise ValueError("a duration is a number with d, h or m, e.g. 36h")
    value, unit = float(match[1]), match[2] or "h"
    return value * {"d": 24.0, "h": 1.0, "m": 1 / 60}[unit]
