"""Hyperparameter sweeps: Ray Tune launches one full Ray Train run per trial.

A sweep file names a base run config and a search space over dotted config keys (`spec`).
Tune samples it, schedules the trials (ASHA, FIFO or PBT) and decides how many run at once
(`search`). Each trial is an ordinary training run named `<sweep>-<trial id>` that resumes
from its own checkpoints however often it restarts (`trial`). MLflow holds one parent run
per sweep and one nested child run per trial, reused when a sweep is restored (`runs`). The
sweep's folder (local, or in a bucket) holds `sweep.json`, Tune's state and the trials' run
directories (`record`).
`driver` runs a sweep end to end; `report` ranks its trials into a table and a PNG
(`plots`).
"""

from raytrain_lm.sweeps.driver import connect_ray, run_sweep
from raytrain_lm.sweeps.record import SWEEP_FILE, TRIALS_DIR, TUNE_DIR, trial_starts
from raytrain_lm.sweeps.report import collect, format_table, log_uniform_keys, report, swept_keys

# CloseTrialRuns, TrialRuns: the saved Tune state of a sweep begun before this package
# split looks for them here.
from raytrain_lm.sweeps.runs import (
    TAG_PBT_DONOR,
    TAG_PBT_VALUES,
    TAG_STOPPED_EARLY,
    TAG_SWEEP,
    TAG_TRIAL,
    CloseTrialRuns,
    TrialRuns,
)
from raytrain_lm.sweeps.search import derive_max_concurrent, param_space
from raytrain_lm.sweeps.spec import PBT_MUTABLE, SchedulerSpec, Sweep, SweepSpec, load_sweep

__all__ = [
    "PBT_MUTABLE",
    "SWEEP_FILE",
    "TAG_PBT_DONOR",
    "TAG_PBT_VALUES",
    "TAG_STOPPED_EARLY",
    "TAG_SWEEP",
    "TAG_TRIAL",
    "TRIALS_DIR",
    "TUNE_DIR",
    "CloseTrialRuns",
    "SchedulerSpec",
    "Sweep",
    "SweepSpec",
    "TrialRuns",
    "collect",
    "connect_ray",
    "derive_max_concurrent",
    "format_table",
    "load_sweep",
    "log_uniform_keys",
    "param_space",
    "report",
    "run_sweep",
    "swept_keys",
    "trial_starts",
]
