"""raytrain-lm: train language models on Ray clusters: elastic, spot-tolerant, fast."""

from raytrain_lm.api import evaluate, export, sweep, sweep_report, train
from raytrain_lm.config import RunConfig, load_config
from raytrain_lm.results import metric_history, sample

__version__ = "0.1.0"
__all__ = [
    "train",
    "sweep",
    "sweep_report",
    "export",
    "evaluate",
    "metric_history",
    "sample",
    "load_config",
    "RunConfig",
    "__version__",
]
