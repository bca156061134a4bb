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
import signal
import subprocess
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray.train import UserCallback
from ray.tune import Callback

from raytrain_lm.config import (
    RUN_NAME_PATTERN,
    RunConfig,
    closest_key_hint,
    fix_yaml_floats,
    flatten,
    format_validation_error,
    load_config,
    read_yaml_file,
    set_dotted,
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
TAG_PBT_DONOR = "raytrain_lm.pbt.donor"
TAG_PBT_VALUES = "raytrain_lm.pbt.values"
POINTER_FILE = "train_checkpoint.json"
# What PBT may change when a trial continues from another trial's checkpoint: settings the
# training loop reads at every step. The model, the data and the batch define the weights and
# the data position a checkpoint holds; weight decay and Adam's betas are restored from the
# optimizer state in the checkpoint, so a mutated value would silently not apply.
PBT_MUTABLE = (
    "optim.lr",
    "optim.min_lr",
    "optim.warmup_steps",
    "optim.decay_steps",
    "optim.grad_clip",
)


class SchedulerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["asha", "fifo", "pbt"] = "asha"
    grace_period: int | None = Field(
        None, ge=1, description="steps before ASHA may stop a trial (default: first report)"
    )
    reduction_factor: float = Field(2.0, gt=1.0)
    # PBT
    perturbation_interval: int | None = Field(
        None, ge=1, description="steps between PBT perturbations (default: checkpoint interval)"
    )
    hyperparam_mutations: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="PBT: dotted key -> choice/uniform/loguniform/randint"
    )
    quantile_fraction: float = Field(0.25, gt=0.0, le=0.5)
    resample_probability: float = Field(0.25, ge=0.0, le=1.0)
    synch: bool = Field(False, description="PBT: perturb all trials together at each interval")


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
            hint = closest_key_hint(RunConfig, tuple(parts[: i + 1]))
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
    set_dotted(tree, key.split("."), value)
    try:
        RunConfig.model_validate(tree)
    except ValidationError as err:
        raise _origin_error(origin, f"space: {format_validation_error(err, key)}") from None


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
    raw = read_yaml_file(file, "sweep")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level must be a mapping with at least `space:`")
    try:
        spec = SweepSpec.model_validate(fix_yaml_floats(raw))
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
    pbt = spec.scheduler.kind == "pbt"
    if not (pbt and spec.scheduler.hyperparam_mutations and not spec.space):
        _check_space(origin, spec.space, base)
    if pbt:
        _check_pbt(origin, spec, base)
    elif spec.scheduler.hyperparam_mutations or spec.scheduler.perturbation_interval:
        raise _origin_error(
            origin, "scheduler: hyperparam_mutations and perturbation_interval need kind: pbt"
        )
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


def _check_pbt(origin: str, spec: SweepSpec, base: dict[str, Any]) -> None:
    s = spec.scheduler
    if not s.hyperparam_mutations:
        raise _origin_error(origin, "scheduler: pbt needs hyperparam_mutations (e.g. optim.lr)")
    for key in s.hyperparam_mutations:
        if key not in PBT_MUTABLE:
            raise _origin_error(
                origin,
                f"scheduler.hyperparam_mutations: PBT cannot change '{key}' mid-run (a trial "
                f"continues from another trial's checkpoint); mutable: {', '.join(PBT_MUTABLE)}",
            )
        if "grid" in s.hyperparam_mutations[key]:
            raise _origin_error(
                origin, f"scheduler.hyperparam_mutations.{key}: grid is not a mutation; use choice"
            )
    _check_space(f"{origin}: scheduler.hyperparam_mutations", s.hyperparam_mutations, base)
    if spec.search == "optuna":
        raise _origin_error(origin, "search: optuna cannot drive a pbt scheduler; use random")
    every = base["checkpoint"]["every_steps"]
    if (s.perturbation_interval or every) % every:
        raise _origin_error(
            origin,
            f"scheduler.perturbation_interval ({s.perturbation_interval}) must be a multiple of "
            f"checkpoint.every_steps ({every}): PBT copies the checkpoint of each perturbation",
        )


# ------------------------------------------------------------------------------- Tune objects


def param_space(
    space: dict[str, dict[str, Any]], mutations: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Tune's search space; PBT's mutated keys not in `space` start from their mutation's
    distribution."""
    from ray import tune

    space = {**(mutations or {}), **space}

    make = {
        "choice": tune.choice,
        "grid": tune.grid_search,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    return {key: make[kind](args) for key, e in space.items() for kind, args in e.items()}


def derive_max_concurrent(
    cfg: RunConfig, resources: dict[str, float], gpu: bool, fixed_size: bool = True
) -> int:
    """How many trials fit side by side now: each needs its largest worker group plus the
    CPUs kept for Ray Data (and GPUs when it trains on GPUs), plus its own Tune actor.

    On a Ray that cannot grow (`fixed_size`, a local one) a sweep where no trial fits is
    refused: its first trial would start and then wait forever for Ray Data's readers. An
    autoscaling cluster may still add the nodes, so there one trial at a time is assumed.
    """
    from raytrain_lm.runtime import cpus_needed

    scaling = cfg.scaling
    per_trial_cpus = cpus_needed(scaling) + TRIAL_CPU
    fits = int(resources.get("CPU", 0.0) // per_trial_cpus)
    if gpu:
        per_trial_gpus = scaling.max_size * scaling.gpus_per_worker
        fits = min(fits, int(resources.get("GPU", 0.0) // per_trial_gpus))
    if fits == 0 and fixed_size:
        raise UserError(
            f"cannot schedule a trial: each needs {per_trial_cpus:g} CPUs ({scaling.max_size} "
            f"workers x {scaling.cpus_per_worker:g} + {scaling.data_cpus:g} for Ray Data + "
            f"{TRIAL_CPU:g} for its Tune actor)"
            + (f" and {per_trial_gpus:g} GPUs" if gpu else "")
            + f"; this Ray has {resources.get('CPU', 0.0):g} CPUs"
            + (f" and {resources.get('GPU', 0.0):g} GPUs" if gpu else "")
        )
    return max(1, fits)


def _mutation(entry: dict[str, Any]):
    """PBT shifts a `choice` to a neighbouring value and scales a range by 0.8 or 1.2."""
    from ray import tune

    kind, args = next(iter(entry.items()))
    if kind == "choice":
        return list(args)
    return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[kind](
        *args
    )


def _keep_in_range(bounds: dict[str, tuple[float, float]], config: dict[str, Any]):
    """PBT's custom_explore_fn: a scaled value stays inside the declared range, where
    load_sweep checked it is a valid setting."""
    for key, (low, high) in bounds.items():
        value = config[key]
        config[key] = type(value)(min(max(value, low), high))
    return config


def _scheduler(sweep: Sweep):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = sweep.spec.scheduler
    every = sweep.base["checkpoint"]["every_steps"]
    if s.kind == "fifo":
        return FIFOScheduler()
    if s.kind == "pbt":
        bounds = {}
        for key, entry in s.hyperparam_mutations.items():
            kind, args = next(iter(entry.items()))
            if kind != "choice":
                bounds[key] = (args[0], args[1] - 1 if kind == "randint" else args[1])
        return PopulationBasedTraining(
            time_attr=TIME_ATTR,
            perturbation_interval=s.perturbation_interval or every,
            hyperparam_mutations={k: _mutation(e) for k, e in s.hyperparam_mutations.items()},
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
            custom_explore_fn=partial(_keep_in_range, bounds),
            synch=s.synch,
        )
    return ASHAScheduler(
        time_attr=TIME_ATTR,
        # One past the last step: a trial that reaches max_steps must end by itself (summary,
        # final weights, closing its MLflow run), not be stopped by ASHA at its last report.
        max_t=sweep.base["training"]["max_steps"] + 1,
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
        set_dotted(tree, key.split("."), value)
    tree["name"], tree["output_dir"] = run_name, trials_dir
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise UserError(format_validation_error(err, f"trial {run_name}")) from None


class ReportToTune(UserCallback):
    """Runs in the trial's Ray Train controller: hands every report, with the path of the
    checkpoint Ray Train has already persisted, to the trial's actor (`_forward_reports`).

    Ray's `TuneReportCallback` does the same but can only pass metrics; PBT needs a Tune
    checkpoint with each report, to hand to the trials that copy this one."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        item = dict(metrics[0])
        item[POINTER_FILE] = checkpoint.path if checkpoint is not None else None
        # Blocks until the trial took the previous report: Tune's decisions (stop, pause)
        # come while the trial is at the step that caused them, as with TuneReportCallback.
        self.queue.put(item)


def _report(metrics: dict[str, Any], train_checkpoint: str | None) -> None:
    """tune.report with a Tune checkpoint that only points at the trial's Ray Train
    checkpoint: the weights stay where they are, once."""
    from ray import tune

    if train_checkpoint is None:
        tune.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / POINTER_FILE).write_text(json.dumps({"checkpoint": train_checkpoint}))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def _forward_reports(queue, finished: threading.Event, errors: list[Exception]) -> None:
    """The trial actor's side of ReportToTune, in a thread of its own: the trial's function
    thread is busy in Ray Train's fit(). Runs until the Train run has ended and every report
    is passed on."""
    from ray.util.queue import Empty

    while True:
        try:
            item = queue.get(timeout=0.5)
        except Empty:
            if finished.is_set():
                return
            continue
        if errors:
            continue  # keep taking reports, or the Train controller would block on the queue
        try:
            _report(item, item.pop(POINTER_FILE))
        except Exception as exc:  # raised by run_trial once training is over
            errors.append(exc)


def _adopt(pointer: dict[str, Any], run_dir: Path) -> tuple[str, int] | None:
    """PBT's exploit: this trial continues from another trial's checkpoint. Copies it into
    this trial's run directory as its only checkpoint (the trial's own are superseded), with
    the donor's config as the run's saved config, so the run resumes from it (launch._fit
    drops Ray Train's list of the removed checkpoints). Returns the
    donor's run name and step, or None when the checkpoint is the trial's own."""
    import shutil

    from raytrain_lm.trainer.checkpoint import (
        CONFIG_FILE,
        is_complete,
        latest_complete_checkpoint,
        read_state,
    )

    source = Path(pointer["checkpoint"])
    if source.parent.resolve() == run_dir.resolve():
        return None  # a pause or a restore: the run resumes from its own newest checkpoint
    if not is_complete(source):
        # Pruned meanwhile (the donor trained on past checkpoint.keep_last): its newest.
        newer = latest_complete_checkpoint(source.parent)
        if newer is None:
            raise RuntimeError(f"PBT: no complete checkpoint left in {source.parent} to copy")
        print(f"[raytrain-lm] PBT: {source.name} was pruned; copying {newer.name} instead")
        source = newer
    run_dir.mkdir(parents=True, exist_ok=True)
    for own in run_dir.glob("checkpoint_*"):
        shutil.rmtree(own, ignore_errors=True)
    target = run_dir / source.name
    shutil.copytree(source, target)
    shutil.copyfile(source / CONFIG_FILE, run_dir / CONFIG_FILE)
    return source.parent.name, read_state(target).step


def run_trial(values: dict[str, Any], context: dict[str, Any]) -> None:
    """Tune's trainable: one full Ray Train run with this trial's values, resuming its own
    run directory when it has one (or, under PBT, continuing from the checkpoint of the trial
    it was told to copy)."""
    import ray
    from ray import tune
    from ray.util.queue import Queue

    from raytrain_lm.trainer import faults
    from raytrain_lm.trainer.launch import default_ray_env
    from raytrain_lm.trainer.launch import train as launch_train

    trial_id = tune.get_context().get_trial_id()
    name = trial_run_name(context["name"], trial_id)
    cfg = trial_config(context["base"], values, name, context["trials_dir"])
    mutable = tuple(context.get("pbt_mutations") or ())
    adopted = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            pointer = json.loads((Path(directory) / POINTER_FILE).read_text())
        adopted = _adopt(pointer, Path(context["trials_dir"]) / name)
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
    if mutable:
        # MLflow params are write-once: the trial's first values stay its params, the values
        # it trains with now are a tag (and train/lr shows the schedule step by step).
        tags[TAG_PBT_VALUES] = json.dumps({k: values[k] for k in mutable})
    if adopted is not None:
        tags[TAG_PBT_DONOR] = f"{adopted[0]}@{adopted[1]}"
        print(f"[raytrain-lm] PBT: continuing from {adopted[0]} at step {adopted[1]}", flush=True)
    queue = Queue(1, actor_options={"num_cpus": 0})
    finished, errors = threading.Event(), []
    forwarder = threading.Thread(
        target=_forward_reports, args=(queue, finished, errors), daemon=True
    )
    forwarder.start()
    try:
        summary = launch_train(
            cfg,
            parent_run_id=context.get("parent_run_id"),
            tags=tags,
            callbacks=[ReportToTune(queue)],
            may_change=mutable,
        )
    finally:
        finished.set()
    forwarder.join()
    if errors:
        raise errors[0]
    # A trial resumed after it had already trained to the end reports nothing through Train:
    # give Tune its final result either way.
    _report(
        {METRIC: summary["val_loss"], TIME_ATTR: summary["steps"], "done_steps": True},
        summary["checkpoint"],
    )


def _accelerator(kind: str | list[str] | None) -> str:
    if kind is None:
        return "cpu"
    return kind if isinstance(kind, str) else ",".join(kind)


def _git_commit(*places: Path) -> str | None:
    """The commit of the first of `places` inside a git checkout: the code that trains (when
    it runs from a checkout), else the sweep file's project (an installed package)."""
    for where in places:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return None


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

    def on_trial_complete(self, iteration, trials, trial, **info):
        # run_trial's last report says it trained to the end; without it, the scheduler
        # stopped the trial (whose Train run may have marked its MLflow run FAILED as it went)
        stopped_early = not (trial.last_result or {}).get("done_steps")
        self._settle(trial.trial_id, "FINISHED", stopped_early=stopped_early)

    def on_trial_error(self, iteration, trials, trial, **info):
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
        wait_s=sweep.base["tracking"]["start_wait_s"],
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


def connect_ray(sweep: Sweep, base_cfg: RunConfig) -> tuple[bool, int]:
    """Joins or starts Ray for `sweep`; returns whether trials train on GPUs and how many
    run at once. A local Ray sized for one run would leave no room for the trial's own
    actor: the Train worker would take its CPU and Ray Data's readers would wait forever."""
    import ray

    from raytrain_lm.runtime import ensure_ray, joins_cluster, use_gpu

    ensure_ray(base_cfg.scaling, extra_cpus=TRIAL_CPU)
    gpu = use_gpu(base_cfg.scaling)
    fitting = derive_max_concurrent(
        base_cfg, ray.cluster_resources(), gpu, fixed_size=not joins_cluster(base_cfg.scaling)
    )
    return gpu, sweep.spec.max_concurrent_trials or fitting


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Runs or resumes `sweep`; returns its summary (ranked trials, best first)."""
    from ray import tune

    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.sweeps_report import collect, format_table, plot_report
    from raytrain_lm.tracking import resolve_tracking_uri
    from raytrain_lm.trainer.faults import ENV_VAR as FAULT_ENV
    from raytrain_lm.trainer.launch import default_ray_env

    base_cfg = RunConfig.model_validate(sweep.base)
    default_ray_env()
    # Checked before anything is written: a sweep refused here leaves no trace.
    gpu, concurrent = connect_ray(sweep, base_cfg)
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
    git_commit = _git_commit(Path(__file__).resolve().parent, Path(sweep.source).parent)
    parent = _open_parent(sweep, record, git_commit)
    record["parent_run_id"] = parent.run_id
    (sweep.directory / SWEEP_FILE).write_text(json.dumps(record, indent=2))
    parent.log_artifact(sweep.source, "sweep")

    context = {
        "name": sweep.name,
        "base": base,
        "trials_dir": str(trials_dir),
        "parent_run_id": parent.run_id,
        "git_commit": git_commit,
        "fault": os.environ.get(FAULT_ENV),
        "pbt_mutations": list(sweep.spec.scheduler.hyperparam_mutations)
        if sweep.spec.scheduler.kind == "pbt"
        else [],
    }
    # The trial's actor only waits on Ray Train, which reserves its own workers: a trial
    # holding a whole CPU would keep Train workers (and Ray Data) from scheduling. Tune
    # refuses a trial that asks for nothing at all, hence a sliver.
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, context=context), {"CPU": TRIAL_CPU}
    )
    runs = TrialRuns(record["tracking_uri"], parent.run_id)
    tune_path = sweep.directory / TUNE_DIR
    space = param_space(sweep.spec.space, sweep.spec.scheduler.hyperparam_mutations)
    if tune.Tuner.can_restore(str(tune_path)):
        print(f"[raytrain-lm] resuming sweep '{sweep.name}' from {tune_path}", flush=True)
        tuner = tune.Tuner.restore(
            str(tune_path),
            trainable=trainable,
            param_space=space,
            resume_unfinished=True,
            resume_errored=True,
        )
        # Tune restores the RunConfig it pickled, with its CloseTrialRuns: that one closes the
        # same MLflow runs (the parent run id never changes), so nothing needs replacing, and
        # the end-of-sweep pass below reads only the public ResultGrid.
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space,
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
                # Tune's checkpoints are pointers to the trials' own (see _report); PBT warns
                # below 3 (a donor's may go before the trials copying it have started).
                checkpoint_config=tune.CheckpointConfig(num_to_keep=4),
                callbacks=[CloseTrialRuns(runs)],
                verbose=1,
            ),
        )
    print(
        f"[raytrain-lm] sweep '{sweep.name}': {len(sweep.spec.space)} keys, up to "
        f"{concurrent} trials at a time; MLflow parent run {parent.run_id} at "
        f"{record['tracking_uri']}",
        flush=True,
    )
    # Tune installs its own Ctrl-C handler (first press: save state and stop trials) and
    # leaves it in place; a notebook or script that goes on after the sweep gets its own back.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.getsignal(signal.SIGINT) if in_main_thread else None
    try:
        grid = tuner.fit()
    except BaseException:
        _settle_children(runs, {}, set())
        parent.finish("KILLED")
        raise
    finally:
        if in_main_thread and previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    # A trial that trained to the end says so in its last report (`done_steps`); Tune marks
    # the last result of a trial the scheduler stopped `done`. A trial still running or
    # pending when the driver stopped has neither, nor an error. Trial statuses cannot tell:
    # on Ctrl-C Tune saves its state, then stops the running trials, which leaves them
    # TERMINATED in the result grid (RUNNING on disk). Nor can `done` alone: a trial that
    # finished just before an interrupted driver saved its state may be restored without it.
    completed = {
        r.metrics["trial_id"]: not r.metrics.get("done_steps")
        for r in grid
        if r.error is None
        and (r.metrics.get("done") or r.metrics.get("done_steps"))
        and r.metrics.get("trial_id")
    }
    errored = {r.metrics["trial_id"] for r in grid if r.error and r.metrics.get("trial_id")}
    errors = sum(1 for r in grid if r.error)
    ended = len(completed) + errors
    interrupted = ended < len(grid) or len(grid) < _trial_count(sweep.spec)
    _settle_children(runs, completed, errored)

    keys = swept_keys(record)
    rows = collect(runs, keys)
    png = sweep.directory / "report.png"
    if rows:
        plot_report(rows, keys, runs.client, png, log_uniform_keys(record))
        parent.log_artifact(png)
        best = next((r for r in rows if r["val_loss"] is not None), None)
        if best is not None:
            parent.log_metrics({"best/val_loss": best["val_loss"]}, step=0)
    print(format_table(rows, keys), flush=True)
    if interrupted:
        print(
            f"[raytrain-lm] sweep '{sweep.name}' interrupted; run the same command again to "
            "resume it",
            file=sys.stderr,
            flush=True,
        )
    parent.finish("KILLED" if interrupted else ("FAILED" if errors == len(grid) else "FINISHED"))
    return {
        "sweep": sweep.name,
        "directory": str(sweep.directory),
        "mlflow_parent_run_id": parent.run_id,
        "interrupted": interrupted,
        "trials": len(grid),
        "errored": errors,
        "report": str(png) if rows else None,
        "ranked": rows,
    }


def _trial_count(spec: SweepSpec) -> int:
    """How many trials the sweep has once every one was created: each sample of the space is
    repeated for every combination of grid values."""
    count = spec.num_samples
    for entry in spec.space.values():
        count *= len(entry.get("grid", [None]))
    return count


def _settle_children(runs: TrialRuns, completed: dict[str, bool], errored: set[str]) -> None:
    """No child run stays RUNNING once the driver stops: finished (`completed` maps a trial
    to whether the scheduler stopped it early), failed, or otherwise KILLED until a restore
    reopens it. An early-stopped trial's run may have been marked FAILED by the Train run the
    scheduler ended: it is FINISHED."""
    try:
        children = runs.children()
    except Exception as exc:
        print(f"[raytrain-lm] warning: could not list the sweep's MLflow runs: {exc}")
        return
    for run in children:
        trial_id = run.data.tags.get(TAG_TRIAL)
        early = completed.get(trial_id, False)
        if run.info.status != "RUNNING" and not (early and run.info.status == "FAILED"):
            continue
        try:
            if trial_id in errored:
                runs.close(run, "FAILED")
            elif trial_id in completed:
                runs.close(run, "FINISHED", stopped_early=early)
            else:
                runs.client.set_terminated(run.info.run_id, status="KILLED")
        except Exception as exc:
            print(f"[raytrain-lm] warning: could not end MLflow run {run.info.run_id}: {exc}")


def swept_keys(record: dict[str, Any]) -> list[str]:
    """The keys a sweep's report shows: its space, then PBT's mutated keys (whose MLflow
    params are the values a trial started with)."""
    mutations = (record.get("scheduler") or {}).get("hyperparam_mutations") or {}
    return [*record["space"], *(k for k in mutations if k not in record["space"])]


def log_uniform_keys(record: dict[str, Any]) -> frozenset[str]:
    """Keys sampled log-uniformly (in the space, or as a PBT mutation): plotted on a log axis."""
    mutations = (record.get("scheduler") or {}).get("hyperparam_mutations") or {}
    return frozenset(
        key for key, entry in {**mutations, **record["space"]}.items() if "loguniform" in entry
    )


def sweep_directory(name: str, output_dir: str | Path = "runs") -> Path:
    directory = Path(output_dir).resolve() / name
    if not (directory / SWEEP_FILE).is_file():
        raise UserError(f"no sweep '{name}' in {Path(output_dir).resolve()} (no {SWEEP_FILE})")
    return directory
