"""The sweep file: its schema (`SweepSpec`, `SchedulerSpec`) and `load_sweep`, which reads
it and checks everything (keys, values, ranges, the PBT rules, the searcher) before anything
runs, with one-line errors naming the file and key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

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
from raytrain_lm.storage import Location, is_uri, join

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
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

    def trial_count(self) -> int:
        """How many trials the sweep has once every one was created: each sample of the
        space is repeated for every combination of grid values."""
        count = self.num_samples
        for entry in self.space.values():
            count *= len(entry.get("grid", [None]))
        return count


class Sweep(BaseModel):
    """A validated sweep: its spec, the base run config as a tree, and where it lives (an
    absolute local folder or a bucket URI: `sweep_directory`)."""

    spec: SweepSpec
    name: str
    base: dict[str, Any]
    source: str
    directory: Annotated[str, AfterValidator(Location)]


def sweep_directory(output_dir: str | Path, name: str) -> Location:
    """`<output_dir>/<name>`: under a bucket URI (`s3://`, `gs://`) as given, else the local
    folder made absolute."""
    output_dir = str(output_dir)
    if is_uri(output_dir) and not output_dir.startswith("file://"):
        return join(output_dir, name)
    return Location(str(Path(output_dir.removeprefix("file://")).resolve() / name))


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


def _overrides_from_tree(tree: dict[str, Any]) -> list[str]:
    # JSON is YAML, so parse_override reads each value back exactly (lists, strings, nulls)
    return [f"{k}={json.dumps(v)}" for k, v in flatten(tree).items()]


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Reads and validates a sweep file; `overrides` (`section.key=value`) apply to the base.

    Raises `UserError` naming the file and key on any problem, before anything runs.
    """
    origin = str(path)
    file = Path(path)
    spec = _read_spec(path, file)
    cfg = _load_base(path, file, spec, overrides)
    base = cfg.model_dump(mode="json")
    _check_scheduler(origin, spec, base)
    if spec.search == "optuna":
        _check_optuna(origin, spec)
    name = spec.name or file.stem
    if not re.fullmatch(RUN_NAME_PATTERN, name):
        raise UserError(f"{path}: sweep name '{name}' must match {RUN_NAME_PATTERN}; set name:")
    directory = sweep_directory(cfg.output_dir, name)
    return Sweep(spec=spec, name=name, base=base, source=str(file.resolve()), directory=directory)


def _read_spec(path: str | Path, file: Path) -> SweepSpec:
    raw = read_yaml_file(file, "sweep")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level must be a mapping with at least `space:`")
    try:
        return SweepSpec.model_validate(fix_yaml_floats(raw))
    except ValidationError as err:
        raise UserError(format_validation_error(err, str(path), SweepSpec)) from None


def _load_base(
    path: str | Path, file: Path, spec: SweepSpec, overrides: list[str] | None
) -> RunConfig:
    """The run config every trial starts from: the `base:` file (relative to the sweep
    file), then the sweep's `config:` tree, then `overrides`."""
    origin = str(path)
    base_file = None
    if spec.base is not None:
        base_file = (file.parent / spec.base).resolve()
        if not base_file.is_file():
            raise UserError(f"{path}: base config not found: {spec.base}")
    try:
        cfg = load_config(base_file, [*_overrides_from_tree(spec.config), *(overrides or [])])
    except UserError as exc:
        raise _origin_error(origin, str(exc)) from None
    if cfg.checkpoint.every_steps == "auto":
        raise _origin_error(
            origin, "a sweep compares trials at their checkpoints: give checkpoint.every_steps "
            "a number of steps, not auto",
        )  # fmt: skip
    if cfg.checkpoint.every_steps % cfg.training.eval_every:
        # Ray Train reports at checkpoints: each report must carry a fresh val loss to rank by.
        raise _origin_error(
            origin,
            f"checkpoint.every_steps ({cfg.checkpoint.every_steps}) must be a multiple of "
            f"training.eval_every ({cfg.training.eval_every}) so every report has a val loss",
        )
    return cfg


def _check_scheduler(origin: str, spec: SweepSpec, base: dict[str, Any]) -> None:
    """The space (a pbt sweep may sample nothing but its mutations), then PBT's own rules,
    which no other scheduler's settings may borrow."""
    pbt = spec.scheduler.kind == "pbt"
    if not (pbt and spec.scheduler.hyperparam_mutations and not spec.space):
        _check_space(origin, spec.space, base)
    if pbt:
        _check_pbt(origin, spec, base)
    elif spec.scheduler.hyperparam_mutations or spec.scheduler.perturbation_interval:
        raise _origin_error(
            origin, "scheduler: hyperparam_mutations and perturbation_interval need kind: pbt"
        )


def _check_optuna(origin: str, spec: SweepSpec) -> None:
    grids = [k for k, e in spec.space.items() if "grid" in e]
    if grids:
        raise _origin_error(origin, f"search: optuna cannot sample grid keys ({grids[0]})")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise _origin_error(
            origin, "search: optuna is not installed (pip install optuna)"
        ) from None
