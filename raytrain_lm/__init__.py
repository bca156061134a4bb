"""raytrain-lm: train language models on Ray clusters: elastic, spot-tolerant, fast.

The public names below are imported on first use (PEP 562), so that `import raytrain_lm.X`
costs only what X needs: the model, the training step and the GPU check run where neither
Ray, MLflow nor pydantic is installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "train": "raytrain_lm.api",
    "sweep": "raytrain_lm.api",
    "sweep_report": "raytrain_lm.api",
    "export": "raytrain_lm.api",
    "evaluate": "raytrain_lm.api",
    "metric_history": "raytrain_lm.results",
    "checkpoint_models": "raytrain_lm.results",
    "sample": "raytrain_lm.results",
    "load_config": "raytrain_lm.config",
    "RunConfig": "raytrain_lm.config",
}
__all__ = [
    "train",
    "sweep",
    "sweep_report",
    "export",
    "evaluate",
    "metric_history",
    "checkpoint_models",
    "sample",
    "load_config",
    "RunConfig",
    "__version__",
]

if TYPE_CHECKING:
    from raytrain_lm.api import evaluate, export, sweep, sweep_report, train
    from raytrain_lm.config import RunConfig, load_config
    from raytrain_lm.results import checkpoint_models, metric_history, sample


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'raytrain_lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


if "ipykernel.zmqshell" in sys.modules:
    # A Jupyter kernel, where `import raytrain_lm` comes before the notebook's `import ray`:
    # Ray's notebook hints (tqdm's and its own, about ipywidgets) and colour codes are settled
    # before Ray first prints them (see console.py).
    from raytrain_lm.console import quiet_notebook

    quiet_notebook()
