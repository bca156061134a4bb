"""The price catalog `raytrain-lm plan` reads: per accelerator type, its memory, GPUs per node,
and per capacity (spot, on-demand) the hourly price per GPU and the interruptions per node-hour.
A YAML file users edit (`prices.yaml` beside this module is the shipped example, dated and
with its sources); checked like the run config, so a misspelt key names the closest valid one.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError

from raytrain_lm.config.base import _Section
from raytrain_lm.config.loading import format_validation_error, read_yaml_file
from raytrain_lm.errors import UserError

DEFAULT_CATALOG = Path(__file__).with_name("prices.yaml")


class Capacity(_Section):
    usd_per_gpu_hour: float = Field(gt=0)
    interruptions_per_node_hour: float = Field(0.0, ge=0)


class AcceleratorType(_Section):
    memory_gib: float = Field(gt=0)
    gpus_per_node: int = Field(1, ge=1)
    peak_tflops: float | None = Field(
        None, gt=0, description="dense bf16 peak; unset: raytrain_lm/devices.py's table by name"
    )
    on_demand: Capacity | None = None
    spot: Capacity | None = None

    def capacities(self) -> dict[str, Capacity]:
        return {k: v for k, v in (("spot", self.spot), ("on_demand", self.on_demand)) if v}


class Catalog(_Section):
    as_of: str
    source: str
    types: dict[str, AcceleratorType]


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The catalog at `path` (default: the shipped example), or a one-line UserError."""
    path = Path(path) if path is not None else DEFAULT_CATALOG
    data = read_yaml_file(path, "price catalog")
    try:
        return Catalog.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, str(path), Catalog)) from None
