"""From YAML files and dotted overrides to a `RunConfig`, and back to YAML. Every problem
becomes one line naming the key; the sweep spec (sweeps/spec.py) reads its files and reports
its errors with these same helpers.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_lm.config.run import RunConfig
from raytrain_lm.errors import UserError
from raytrain_lm.redaction import REDACTED, redact_tree


def closest_key_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """Names the valid key nearest to an unknown one at `loc` (a pydantic error location)."""
    section: type[BaseModel] = model
    parts = list(loc[:-1])
    while parts:
        field = section.model_fields.get(str(parts.pop(0)))
        annotation = getattr(field, "annotation", None)
        if typing.get_origin(annotation) is dict and parts:  # a mapping of sections: skip its key
            annotation = typing.get_args(annotation)[1]
            parts.pop(0)
        annotation = next(  # `Section | None`
            (a for a in typing.get_args(annotation) if a is not type(None)), annotation
        )
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    valid = list(section.model_fields)
    match = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.0)
    prefix = ".".join(str(p) for p in loc[:-1])
    if not match:
        return ""
    return f"; did you mean '{prefix + '.' if prefix else ''}{match[0]}'?"


def format_validation_error(
    err: ValidationError, origin: str, model: type[BaseModel] = RunConfig
) -> str:
    """The first problem in `err` (raised validating `model` from `origin`) as one line
    naming the key: an unknown key with the closest valid one, a missing key, or a bad value
    with what was given."""
    errors = err.errors()
    # A misspelt key also leaves the key it meant missing: name the misspelling.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        return f"{origin}: unknown key '{key}'{closest_key_hint(model, loc)}"
    if first["type"] == "missing":
        return f"{origin}: missing '{key}'"
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return f"{origin}: {message}"
    return f"{origin}: invalid value for '{key}': {message} (got {first.get('input')!r})"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 0.0003). Values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise UserError(f"override '{text}' is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise UserError(f"override '{text}': cannot parse value: {exc}".splitlines()[0]) from None
    return key.split("."), fix_yaml_floats(value)


def set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """tree[path[0]][path[1]]... = value, creating sections on the way."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override '{'.'.join(path)}': '{part}' is not a section")
        node = child
    node[path[-1]] = value


def fix_yaml_floats(node: Any) -> Any:
    """`node` with strings such as "3e-4" turned into floats (YAML 1.1 reads them as strings)."""
    if isinstance(node, dict):
        return {k: fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [fix_yaml_floats(v) for v in node]
    if isinstance(node, str) and re.fullmatch(r"[-+]?\d*\.?\d+[eE][-+]?\d+", node):
        return float(node)
    return node


def read_yaml_file(path: str | Path, what: str) -> Any:
    """The parsed YAML of `path`; a missing file or bad syntax is a one-line UserError."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{what} file not found: {path}")
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{path}: YAML syntax error{where}: {problem}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Builds the run config from an optional YAML file and `section.key=value` overrides.

    Raises `UserError` naming the offending key (and the closest valid one) on any problem.
    """
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        loaded = read_yaml_file(path, "config")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{path}: top level must be a mapping of sections")
        tree = fix_yaml_floats(loaded)
    for text in overrides or []:
        keys, value = parse_override(text)
        set_dotted(tree, keys, value)
        origin = f"{origin} + overrides" if "overrides" not in origin else origin
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise UserError(format_validation_error(err, origin)) from None


def flatten(cfg: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> scalar, for MLflow params."""
    tree = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_yaml(cfg: RunConfig) -> str:
    """`cfg` as YAML with its secrets hidden (`redaction`): every config a run writes down
    (its run directory, checkpoints, MLflow artifact) or prints goes through here. Readers of
    such a file (resume checks, `generate`, `eval`) need no secret: `read_written_config`."""
    return yaml.safe_dump(redact_tree(cfg.model_dump(mode="json")), sort_keys=False)


def read_written_config(tree: dict[str, Any]) -> RunConfig:
    """A config as a run wrote it down (`to_yaml`, parsed), validated. The values redaction hid
    are left out, so those settings take their defaults: a hidden entry of a mapping (a price,
    a Ray resource named like a credential) is dropped."""
    return RunConfig.model_validate(_without_redacted(tree))


def _without_redacted(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_redacted(v) for k, v in node.items() if v != REDACTED}
    return node
