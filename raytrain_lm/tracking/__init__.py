"""Experiment tracking behind one small interface. MLflow is the implementation; only the
driver and rank 0 ever hold a live tracker, every other rank gets `NullTracker`.

A tracking server that goes away must not end a multi-hour run: `MLflowTracker` sends from a
background thread, keeps whatever could not be sent, retries with backoff, warns once per
outage, and spools unsent metrics to local disk so the driver's tracker for the same run can
send them after the worker that logged them is gone.

- interface.py: `Tracker`, what training logs through, and `NullTracker`;
- mlflow_tracker.py: `MLflowTracker`, the handle of one MLflow run: open, log to, end;
- buffered_sender.py: what could not be stored yet, and the background thread storing it;
- spool.py: unsent metrics on local disk, for the next tracker of the same run;
- runs.py: which MLflow run a tracker logs to (reopened, found or created);
- models.py: each complete checkpoint as a logged model of its run, and reading them back;
- store.py: what a store's address and its errors tell (a store that cannot exist, errors
  that retrying cannot fix, MLflow's retries left to ours);
- wait.py: waiting for a store that does not answer, before a run starts;
- ui.py: how our runs look in MLflow's UI, and how to open it.
"""

from raytrain_lm.tracking.interface import NullTracker, Tracker
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.tracking.spool import SPOOL_ENV

__all__ = ["SPOOL_ENV", "MLflowTracker", "NullTracker", "Tracker"]
