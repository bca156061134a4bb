"""Hyperparameter sweeps: Ray Tune launches one full Ray Train run per trial.

A sweep file names a base run config and a search space over dotted config keys. Each trial
is an ordinary `raytrain-lm train` run (its own run directory, checkpoints, elastic scaling,
fault budgets) named `<sweep>-<trial id>`, so a trial restarted for any reason (a preempted
node, an errored trial retried by Tune, a restored sweep) resumes from its own last complete
checkpoint. Tune only sees the reports that Ray Train forwards through `TuneReportCallback`.

MLflow: the sweep is one parent run, each trial one nested child run. We create and reuse
them ourselves (the run id lives in the sweep folder and in each trial's run folder), so a
restored sweep continues the same runs instead of opening duplicates.

Layout under `<output_dir>/<sweep name>/`: `sweep.json` (what defines the sweep and its
MLflow parent run), `tune/` (Tune's experiment state), `trials/<sweep>-<trial id>/` (the
trials' run directories), `report.png`.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray.tune import Callback

from raytrain_lm.config import (
    RUN_NAME_PATTERN,
    RunConfig,
    _closest_key,
    _fix_yaml_floats,
    _format_validation_error,
    _set_dotted,
    flatten,
    load_config,
)
from raytrain_lm.errors import UserError

SWEEP_FILE = "sweep.json"
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
METRIC = "val_loss"  # what Ray Train reports (loop.py); ranked low to high
TIME_ATTR = "step"  # survives restarts, unlike Tune's training_iteration
KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
TRIAL_CPU = 0.01
TAG_SWEEP = "raytrain_lm.sweep"
TAG_TRIAL = "raytrain_lm.trial_id"
TAG_STOPPED_EARLY = "raytrain_lm.stopped_early"


class SchedulerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["asha", "fifo"] = "asha"
    grace_period: int | None = Field(
        None, ge=1, description="steps before ASHA may stop a trial (default: first report)"
    )
    reduction_factor: float = Field(2.0, gt=1.0)


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=RUN_NAME_PATTERN, description="default: file name")
    base: str | None = Field(None, description="run config YAML, relative to the sweep file")
    config: dict[str, Any] = Field(
        default_factory=dict, description="settings on top of the base, as a (nested) mapping"
    )
    space: dict[str, dict[str, Any]]
    num_samples: int = Field(1, ge=1, description="samples drawn (times every grid point)")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    search: Literal["random", "optuna"] = "random"
    max_concurrent_trials: int | None = Field(None, ge=1, description="default: what fits now")
    seed: int | None = None

    @field_validator("scheduler", mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value


class Sweep(BaseModel):
    """A validated sweep: its spec, the base run config as a tree, and where it lives."""

    spec: SweepSpec
    name: str
    base: dict[str, Any]
    source: str
    directory: Path


# ------------------------------------------------------------------------------- loading


def _origin_error(origin: str, message: str) -> UserError:
    # load_config names its own origin ("defaults + overrides: ..."); say which sweep it was.
    return UserError(f"{origin}: {message}")


def _check_key(origin: str, key: str) -> None:
    """The key must name a setting (not a section) of the run config."""
    parts = key.split(".")
    section: type[BaseModel] = RunConfig
    for i, part in enumerate(parts):
        field = section.model_fields.get(part)
        if field is None:
            hint = _closest_key(RunConfig, tuple(parts[: i + 1]))
            raise _origin_error(origin, f"space: unknown key '{key}'{hint}")
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i < len(parts) - 1 and not is_section:
            raise _origin_error(origin, f"space: '{'.'.join(parts[: i + 1])}' is not a section")
        if i == len(parts) - 1 and is_section:
            raise _origin_error(origin, f"space: '{key}' is a section; sweep one of its keys")
        if is_section:
            section = annotation


def _check_value(origin: str, base: dict[str, Any], key: str, value: Any) -> None:
    tree = copy.deepcopy(base)
    _set_dotted(tree, key.split("."), value)
    try:
        RunConfig.model_validate(tree)
    except ValidationError as err:
        raise _origin_error(origin, f"space: {_format_validation_error(err, key)}") from None


def _check_space(origin: str, space: dict[str, dict[str, Any]], base: dict[str, Any]) -> None:
    if not space:
        raise _origin_error(origin, "space is empty: name at least one key to sweep")
    for key, entry in space.items():
        _check_key(origin, key)
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in KINDS:
            raise _origin_error(
                origin,
                f"space.{key}: expected one of {', '.join(KINDS)} "
                f"(e.g. {{loguniform: [1e-4, 1e-2]}}), got {entry!r}",
            )
        kind, args = next(iter(entry.items()))
        if kind in ("choice", "grid"):
            if not isinstance(args, list) or not args:
                raise _origin_error(origin, f"space.{key}: {kind} needs a non-empty list")
            values = args
        else:
            ok = isinstance(args, list) and len(args) == 2
            ok = ok and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
            if not ok or not args[0] < args[1]:
                raise _origin_error(
                    origin, f"space.{key}: {kind} needs [low, high] with low < high, got {args!r}"
                )
            if kind == "loguniform" and args[0] <= 0:
                raise _origin_error(origin, f"space.{key}: loguniform needs low > 0")
            if kind == "randint" and not all(isinstance(a, int) for a in args):
                raise _origin_error(origin, f"space.{key}: randint needs integers")
            # randint's high end is exclusive, as in Tune
            values = [args[0], args[1] - 1] if kind == "randint" else args
        for value in values:
            _check_value(origin, base, key, value)


def _overrides_from_tree(tree: dict[str, Any]) -> list[str]:
    # JSON is YAML, so parse_override reads each value back exactly (lists, strings, nulls)
    return [f"{k}={json.dumps(v)}" for k, v in flatten(tree).items()]


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Reads and validates a sweep file; `overrides` (`section.key=value`) apply to the base.

    Raises `UserError` naming the file and key on any problem, before anything runs.
    """
    origin = str(path)
    file = Path(path)
    if not file.is_file():
        raise UserError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: YAML syntax error{where}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level must be a mapping with at least `space:`")
    try:
        spec = SweepSpec.model_validate(_fix_yaml_floats(raw))
    except ValidationError as err:
        first = err.errors()[0]
        loc = tuple(str(p) for p in first["loc"])
        key = ".".join(loc)
        if first["type"] == "extra_forbidden":
            section: type[BaseModel] = SweepSpec if len(loc) == 1 else SchedulerSpec
            close = difflib.get_close_matches(loc[-1], list(section.model_fields), 1, 0.0)
            hint = f"; did you mean '{'.'.join([*loc[:-1], close[0]])}'?" if close else ""
            raise UserError(f"{path}: unknown key '{key}'{hint}") from None
        if first["type"] == "missing":
            raise UserError(f"{path}: missing '{key}'") from None
        message = first["msg"].removeprefix("Value error, ")
        raise UserError(
            f"{path}: invalid value for '{key}': {message} (got {first.get('input')!r})"
        ) from None
    base_file = None
    if spec.base is not None:
        base_file = (file.parent / spec.base).resolve()
        if not base_file.is_file():
            raise UserError(f"{path}: base config not found: {spec.base}")
    try:
        cfg = load_config(base_file, [*_overrides_from_tree(spec.config), *(overrides or [])])
    except UserError as exc:
        raise _origin_error(origin, str(exc)) from None
    if cfg.checkpoint.every_steps % cfg.training.eval_every:
        # Ray Train reports at checkpoints: each report must carry a fresh val loss to rank by.
        raise _origin_error(
            origin,
            f"checkpoint.every_steps ({cfg.checkpoint.every_steps}) must be a multiple of "
            f"training.eval_every ({cfg.training.eval_every}) so every report has a val loss",
        )
    base = cfg.model_dump(mode="json")
    _check_space(origin, spec.space, base)
    if spec.search == "optuna":
        grids = [k for k, e in spec.space.items() if "grid" in e]
        if grids:
            raise _origin_error(origin, f"search: optuna cannot sample grid keys ({grids[0]})")
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise _origin_error(
                origin, "search: optuna is not installed (pip install optuna)"
            ) from None
    name = spec.name or file.stem
    if not re.fullmatch(RUN_NAME_PATTERN, name):
        raise UserError(f"{path}: sweep name '{name}' must match {RUN_NAME_PATTERN}; set name:")
    directory = Path(cfg.output_dir).resolve() / name
    return Sweep(spec=spec, name=name, base=base, source=str(file.resolve()), directory=directory)


# ------------------------------------------------------------------------------- Tune objects


def param_space(space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from ray import tune

    make = {
        "choice": tune.choice,
        "grid": tune.grid_search,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    return {key: make[kind](args) for key, e in space.items() for kind, args in e.items()}


def derive_max_concurrent(cfg: RunConfig, resources: dict[str, float], gpu: bool) -> int:
    """How many trials fit side by side now: each needs its largest worker group plus the
    CPUs kept for Ray Data (and GPUs when it trains on GPUs)."""
    from raytrain_lm.runtime import cpus_needed

    scaling = cfg.scaling
    fits = int(resources.get("CPU", 0.0) // (cpus_needed(scaling) + TRIAL_CPU))
    if gpu:
        per_trial = scaling.max_size * scaling.gpus_per_worker
        fits = min(fits, int(resources.get("GPU", 0.0) // per_trial))
    return max(1, fits)


def _scheduler(sweep: Sweep):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep.spec.scheduler
    if s.kind == "fifo":
        return FIFOScheduler()
    every = sweep.base["checkpoint"]["every_steps"]
    return ASHAScheduler(
        time_attr=TIME_ATTR,
        max_t=sweep.base["training"]["max_steps"],
        grace_period=s.grace_period or every,
        reduction_factor=s.reduction_factor,
    )


def _search_alg(sweep: Sweep):
    if sweep.spec.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=sweep.spec.seed)
    return None


# ------------------------------------------------------------------------------- the trial


def trial_run_name(sweep_name: str, trial_id: str) -> str:
    return f"{sweep_name}-{trial_id}"


def trial_config(base: dict[str, Any], values: dict[str, Any], run_name: str, trials_dir: str):
    tree = copy.deepcopy(base)
    for key, value in values.items():
        _set_dotted(tree, key.split("."), value)
    tree["name"], tree["output_dir"] = run_name, trials_dir
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, f"trial {run_name}")) from None


def run_trial(values: dict[str, Any], context: dict[str, Any]) -> None:
    """Tune's trainable: one full Ray Train run with this trial's values, resuming its own
    run directory when it has one."""
    import ray
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_lm.trainer import faults
    from raytrain_lm.trainer.launch import default_ray_env
    from raytrain_lm.trainer.launch import train as launch_train

    trial_id = tune.get_context().get_trial_id()
    name = trial_run_name(context["name"], trial_id)
    cfg = trial_config(context["base"], values, name, context["trials_dir"])
    default_ray_env()
    if context.get("fault"):
        # Fault injection reaches trials the way it reaches `train`: through the environment
        # of the process that launches the Train run, which here is the trial's actor.
        os.environ[faults.ENV_VAR] = context["fault"]
    with open(Path(context["trials_dir"]) / f"{name}.starts", "a", encoding="utf-8") as log:
        log.write(json.dumps({"pid": os.getpid(), "job": ray.get_runtime_context().get_job_id()}))
        log.write("\n")
    tags = {
        TAG_SWEEP: context["name"],
        TAG_TRIAL: trial_id,
        "mlflow.source.git.commit": context.get("git_commit"),
        "ray.job_id": ray.get_runtime_context().get_job_id(),
        "ray.submission_id": os.environ.get("RAY_JOB_SUBMISSION_ID"),
        "accelerator_type": _accelerator(cfg.scaling.accelerator_type),
        "capacity": cfg.scaling.capacity,
        "spot": str(cfg.scaling.capacity == "spot").lower(),
    }
    summary = launch_train(
        cfg,
        parent_run_id=context.get("parent_run_id"),
        tags=tags,
        callbacks=[TuneReportCallback()],
    )
    # A trial resumed after it had already trained to the end reports nothing through Train:
    # give Tune its final result either way.
    tune.report({METRIC: summary["val_loss"], TIME_ATTR: summary["steps"], "done_steps": True})


def _accelerator(kind: str | list[str] | None) -> str:
    if kind is None:
        return "cpu"
    return kind if isinstance(kind, str) else ",".join(kind)


def _git_commit(where: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ------------------------------------------------------------------------------- MLflow runs


class TrialRuns:
    """The sweep's MLflow parent run and its children, as the driver sees them."""

    def __init__(self, uri: str, parent_run_id: str):
        self.uri, self.parent_run_id = uri, parent_run_id

    @property
    def client(self):
        # Built on use: Tune pickles its callbacks (and so this object) with its state.
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def children(self) -> list:
        parent = self.client.get_run(self.parent_run_id)
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [parent.info.experiment_id],
                f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'",
                max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def child(self, trial_id: str):
        return next((r for r in self.children() if r.data.tags.get(TAG_TRIAL) == trial_id), None)

    def close(self, run, status: str, stopped_early: bool = False) -> None:
        """Ends a child run the trial itself could not end (stopped by the scheduler, or the
        sweep interrupted), with its loss curve."""
        from raytrain_lm.sweeps_report import log_loss_curve

        if stopped_early:
            self.client.set_tag(run.info.run_id, TAG_STOPPED_EARLY, "true")
        log_loss_curve(self.client, run.info.run_id)
        self.client.set_terminated(run.info.run_id, status=status)


class CloseTrialRuns(Callback):
    """Gives every trial's MLflow run its end state as soon as Tune knows it."""

    def __init__(self, runs: TrialRuns):
        self.runs = runs
        self.completed: set[str] = set()
        self.errored: set[str] = set()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.completed.add(trial.trial_id)
        # run_trial's last report says it trained to the end; without it, the scheduler
        # stopped the trial (whose Train run may have marked its MLflow run FAILED as it went)
        stopped_early = not (trial.last_result or {}).get("done_steps")
        self._settle(trial.trial_id, "FINISHED", stopped_early=stopped_early)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.errored.add(trial.trial_id)
        self._settle(trial.trial_id, "FAILED")

    def _settle(self, trial_id: str, status: str, stopped_early: bool = False) -> None:
        from raytrain_lm.sweeps_report import log_loss_curve

        try:
            run = self.runs.child(trial_id)
            if run is None:
                return
            if run.info.status == "RUNNING" or (stopped_early and run.info.status == "FAILED"):
                self.runs.close(run, status, stopped_early)
            elif run.info.status == "FINISHED":
                log_loss_curve(self.runs.client, run.info.run_id)
        except Exception as exc:  # the store may be down: the end-of-sweep pass retries
            print(f"[raytrain-lm] warning: could not update trial {trial_id}'s MLflow run: {exc}")


# ------------------------------------------------------------------------------- the sweep


def _record(sweep: Sweep, uri: str) -> dict[str, Any]:
    """sweep.json: created once, then the same sweep name must mean the same sweep."""
    path = sweep.directory / SWEEP_FILE
    defining = {
        "space": sweep.spec.space,
        "num_samples": sweep.spec.num_samples,
        "search": sweep.spec.search,
        "scheduler": sweep.spec.scheduler.model_dump(),
        "base": sweep.base,
    }
    if path.is_file():
        saved = json.loads(path.read_text())
        for key, value in defining.items():
            if json.loads(json.dumps(value)) != saved.get(key):
                raise UserError(
                    f"sweep '{sweep.name}' exists in {sweep.directory} with a different {key}; "
                    f"resume it unchanged or choose another name"
                )
        return saved
    return {"name": sweep.name, "tracking_uri": uri, "source": sweep.source, **defining}


def _open_parent(sweep: Sweep, record: dict[str, Any], git_commit: str | None):
    from raytrain_lm.tracking import MLflowTracker

    parent = MLflowTracker.start(
        record["tracking_uri"],
        sweep.base["tracking"]["experiment"],
        sweep.name,
        record.get("parent_run_id"),
        tags={
            TAG_SWEEP: sweep.name,
            "raytrain_lm.kind": "sweep",
            "mlflow.source.git.commit": git_commit,
        },
    )
    parent.log_params(
        {
            **{f"space.{k}": json.dumps(v) for k, v in sweep.spec.space.items()},
            "num_samples": sweep.spec.num_samples,
            "search": sweep.spec.search,
            "scheduler": sweep.spec.scheduler.kind,
            **{f"base.{k}": v for k, v in flatten(sweep.base).items()},
        }
    )
    return parent


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Runs or resumes `sweep`; returns its summary (ranked trials, best first)."""
    import ray
    from ray import tune

    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.runtime import ensure_ray, use_gpu
    from raytrain_lm.sweeps_report import collect, format_table, plot_report
    from raytrain_lm.tracking import resolve_tracking_uri
    from raytrain_lm.trainer.faults import ENV_VAR as FAULT_ENV
    from raytrain_lm.trainer.launch import default_ray_env

    base_cfg = RunConfig.model_validate(sweep.base)
    default_ray_env()
    ensure_ray(base_cfg.scaling)
    sweep.directory.mkdir(parents=True, exist_ok=True)
    trials_dir = sweep.directory / TRIALS_DIR
    trials_dir.mkdir(exist_ok=True)
    # Trials run in Tune's actors, whose working directory is not ours: pin every path now.
    base = copy.deepcopy(sweep.base)
    base["tracking"]["uri"] = resolve_tracking_uri(base_cfg.tracking)
    base["data"]["cache_dir"] = str(Path(base_cfg.data.cache_dir).resolve())
    if not any(k.startswith("data.") for k in sweep.spec.space) and not base_cfg.data.prepared:
        # Prepare once here rather than in every trial at the same time.
        base["data"]["prepared"] = str(Path(prepare(base_cfg.data).directory).resolve())
    record = _record(sweep, base["tracking"]["uri"])
    git_commit = _git_commit(Path(sweep.source).parent)
    parent = _open_parent(sweep, record, git_commit)
    record["parent_run_id"] = parent.run_id
    (sweep.directory / SWEEP_FILE).write_text(json.dumps(record, indent=2))
    parent.log_artifact(sweep.source, "sweep")

    gpu = use_gpu(base_cfg.scaling)
    concurrent = sweep.spec.max_concurrent_trials or derive_max_concurrent(
        base_cfg, ray.cluster_resources(), gpu
    )
    context = {
        "name": sweep.name,
        "base": base,
        "trials_dir": str(trials_dir),
        "parent_run_id": parent.run_id,
        "git_commit": git_commit,
        "fault": os.environ.get(FAULT_ENV),
    }
    # The trial's actor only waits on Ray Train, which reserves its own workers: a trial
    # holding a whole CPU would keep Train workers (and Ray Data) from scheduling. Tune
    # refuses a trial that asks for nothing at all, hence a sliver.
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, context=context), {"CPU": TRIAL_CPU}
    )
    runs = TrialRuns(record["tracking_uri"], parent.run_id)
    closer = CloseTrialRuns(runs)
    tune_path = sweep.directory / TUNE_DIR
    if tune.Tuner.can_restore(str(tune_path)):
        print(f"[raytrain-lm] resuming sweep '{sweep.name}' from {tune_path}", flush=True)
        tuner = tune.Tuner.restore(
            str(tune_path),
            trainable=trainable,
            param_space=param_space(sweep.spec.space),
            resume_unfinished=True,
            resume_errored=True,
        )
        # Restore keeps the original RunConfig, so our (new) callback object rides along here.
        tuner._local_tuner.get_run_config().callbacks = [closer]
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(sweep.spec.space),
            tune_config=tune.TuneConfig(
                metric=METRIC,
                mode="min",
                scheduler=_scheduler(sweep),
                search_alg=_search_alg(sweep),
                num_samples=sweep.spec.num_samples,
                max_concurrent_trials=concurrent,
            ),
            run_config=tune.RunConfig(
                name=TUNE_DIR,
                storage_path=str(sweep.directory),
                failure_config=tune.FailureConfig(max_failures=base_cfg.fault.max_failures),
                callbacks=[closer],
                verbose=1,
            ),
        )
    print(
        f"[raytrain-lm] sweep '{sweep.name}': {len(sweep.spec.space)} keys, up to "
        f"{concurrent} trials at a time; MLflow parent run {parent.run_id} at "
        f"{record['tracking_uri']}",
        flush=True,
    )
    try:
        grid = tuner.fit()
    except BaseException:
        _settle_children(runs, closer.completed, closer.errored, interrupted=True)
        parent.finish("KILLED")
        raise
    statuses = [t.status for t in grid._experiment_analysis.trials]
    interrupted = any(s not in ("TERMINATED", "ERROR") for s in statuses)
    _settle_children(runs, closer.completed, closer.errored, interrupted)

    rows = collect(runs, list(sweep.spec.space))
    png = sweep.directory / "report.png"
    if rows:
        plot_report(rows, list(sweep.spec.space), runs.client, png)
        parent.log_artifact(png)
        best = next((r for r in rows if r["val_loss"] is not None), None)
        if best is not None:
            parent.log_metrics({"best/val_loss": best["val_loss"]}, step=0)
    print(format_table(rows, list(sweep.spec.space)), flush=True)
    errors = sum(s == "ERROR" for s in statuses)
    if interrupted:
        print(
            f"[raytrain-lm] sweep '{sweep.name}' interrupted; run the same command again to "
            "resume it",
            file=sys.stderr,
            flush=True,
        )
    parent.finish(
        "KILLED" if interrupted else ("FAILED" if errors == len(statuses) else "FINISHED")
    )
    return {
        "sweep": sweep.name,
        "directory": str(sweep.directory),
        "mlflow_parent_run_id": parent.run_id,
        "interrupted": interrupted,
        "trials": len(statuses),
        "errored": errors,
        "report": str(png) if rows else None,
        "ranked": rows,
    }


def _settle_children(runs: TrialRuns, completed, errored, interrupted: bool) -> None:
    """No child run stays RUNNING once the driver stops: ended early, failed, or (when the
    sweep was interrupted) KILLED until a restore reopens it."""
    try:
        children = runs.children()
    except Exception as exc:
        print(f"[raytrain-lm] warning: could not list the sweep's MLflow runs: {exc}")
        return
    for run in children:
        trial_id = run.data.tags.get(TAG_TRIAL)
        early = trial_id in completed and run.data.tags.get(TAG_STOPPED_EARLY) == "true"
        if run.info.status != "RUNNING" and not (early and run.info.status == "FAILED"):
            continue
        try:
            if trial_id in errored:
                runs.close(run, "FAILED")
            elif trial_id in completed:
                runs.close(run, "FINISHED", stopped_early=True)
            elif interrupted:
                runs.client.set_terminated(run.info.run_id, status="KILLED")
        except Exception as exc:
            print(f"[raytrain-lm] warning: could not end MLflow run {run.info.run_id}: {exc}")


def sweep_directory(name: str, output_dir: str | Path = "runs") -> Path:
    directory = Path(output_dir).resolve() / name
    if not (directory / SWEEP_FILE).is_file():
        raise UserError(f"no sweep '{name}' in {Path(output_dir).resolve()} (no {SWEEP_FILE})")
    return directory
