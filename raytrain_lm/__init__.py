"""raytrain-lm: train language models on Ray clusters: elastic, spot-tolerant, fast."""

from raytrain_lm.api import train
from raytrain_lm.config import RunConfig, load_config

__version__ = "0.1.0"
__all__ = ["train", "load_config", "RunConfig", "__version__"]
