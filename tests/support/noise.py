"""What of Ray's and Tune's output must not reach a user (raytrain_lm/console.py), checked in
what the CLI's train, sweep and submit print, in job logs and in the notebooks."""

from __future__ import annotations

import re

RAY_NOISE = {
    "Ray's token-auth notice": re.compile(r"Token authentication is enabled for this Ray"),
    "Ray Train's placement-group cleaner": re.compile(
        r"placement group with cleaner|PlacementGroupCleaner"
    ),
    "Tune's tables": re.compile(
        r"^\s*[╭│├╰]|^Trial status:|^Current best trial:|^View detailed results here", re.M
    ),
    "a TensorBoard hint": re.compile(r"tensorboard --logdir"),
    "Tune's checkpoint log": re.compile(r"Checkpoint successfully created at"),
    "Ray's working-dir notice": re.compile(r"ignored by default when packaging the working dir"),
}


def noise_in(text: str) -> list[str]:
    """Each kind of RAY_NOISE in `text`, with the first line it was found in."""
    found = []
    for what, pattern in RAY_NOISE.items():
        if hit := pattern.search(text):
            start = text.rfind("\n", 0, hit.start()) + 1
            end = text.find("\n", hit.end())
            found.append(f"{what}: {text[start : end if end >= 0 else None][:200]!r}")
    return found
