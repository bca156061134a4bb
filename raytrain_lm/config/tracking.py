"""The `tracking` section and how its store is found. The store is settled here, once, on the
driver (`RunConfig.resolved`), so that workers running in folders and environments of their
own all log to the store the user meant.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from raytrain_lm.config.base import _Section

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_TRACKING_DB = "mlflow.db"


def _absolute_store_uri(uri: str, base_dir: str | Path) -> str:
    """`uri` with a relatively named local store (`sqlite:///mlflow.db`, `./mlruns`) made
    absolute against `base_dir`; servers and absolute paths are returned unchanged."""
    base = os.path.abspath(base_dir)
    if uri.startswith("sqlite:///"):
        path, sep, query = uri.removeprefix("sqlite:///").partition("?")
        if path and not path.startswith(("/", ":memory:")):
            return f"sqlite:///{os.path.normpath(os.path.join(base, path))}{sep}{query}"
    elif uri.startswith((".", "~")) or ("/" in uri and ":" not in uri):
        # a bare path: MLflow's file store (bare words such as `databricks` are not paths)
        return os.path.normpath(os.path.join(base, os.path.expanduser(uri)))
    return uri


class TrackingConfig(_Section):
    enabled: bool = True
    uri: str | None = Field(
        None, description="MLflow URI; else $MLFLOW_TRACKING_URI; else sqlite:///./mlflow.db"
    )
    experiment: str = "raytrain-lm"
    start_wait_s: float = Field(
        600.0,
        ge=0,
        description="how long a run (or a sweep's trial) waits for an unreachable tracking "
        "store before it starts; once running, an outage only buffers metrics",
    )

    def store_uri(self, base_dir: str | Path) -> str:
        """The store a run logs to: `uri`, else $MLFLOW_TRACKING_URI, else an sqlite file
        `mlflow.db`; a local file named relatively is taken relative to `base_dir`."""
        uri = self.uri or os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{DEFAULT_TRACKING_DB}"
        return _absolute_store_uri(uri, base_dir)
