"""The architecture's rules, checked as `make lint` checks them and where import-linter cannot
look: the layers and no cycles (import-linter's contracts in pyproject.toml), the complexity
rules, the model's imports, who calls Ray Train's per-worker API, and the size of a module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.no_ray

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raytrain_lm"
BIN = Path(sys.executable).parent
MODEL_MODULES = ("raytrain_lm.model", "raytrain_lm.llama", "raytrain_lm.causal_lm")
MAX_LINES = 400
# Ray Train's calls that only a worker makes, inside a training function.
PER_WORKER_API = {"get_context", "get_checkpoint", "report", "get_dataset_shard"}
PER_WORKER_ENTRIES = {
    "raytrain_lm/trainer/entry.py",
    "raytrain_lm/trainer/ray_side.py",
    "raytrain_lm/trainer/eval_entry.py",
}


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_import_contracts_hold():
    done = _run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_function_is_too_complex():
    done = _run(
        str(BIN / "ruff"), "check", "--select", "C901,PLR0912,PLR0915", "--no-cache", "raytrain_lm"
    )
    assert done.returncode == 0, done.stdout[-4000:]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _source(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _forbidden_in_the_model(name: str) -> bool:
    return any(name == top or name.startswith(f"{top}.") for top in ("torch.distributed", "ray"))


def test_the_model_never_imports_torch_distributed_or_ray():
    graph = grimp.build_graph("raytrain_lm")
    reached = set(MODEL_MODULES)
    for module in MODEL_MODULES:
        reached |= graph.find_upstream_modules(module)
    offending = {
        module: sorted(n for n in _imports(_source(module)) if _forbidden_in_the_model(n))
        for module in sorted(reached)
    }
    assert not {m: names for m, names in offending.items() if names}
    assert "raytrain_lm.trainer" not in {".".join(m.split(".")[:2]) for m in reached}


def test_only_the_worker_entries_call_ray_trains_per_worker_api():
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = (
                isinstance(node, ast.Attribute)
                and node.attr in PER_WORKER_API
                and ast.unparse(node.value) in {"ray.train", "train"}
            )
            imported = (
                isinstance(node, ast.ImportFrom)
                and node.module in {"ray.train", "ray.train.v2.api.train_fn_utils"}
                and PER_WORKER_API & {alias.name for alias in node.names}
            )
            if called or imported:
                callers.add(path.relative_to(ROOT).as_posix())
    assert callers <= PER_WORKER_ENTRIES, sorted(callers - PER_WORKER_ENTRIES)
    assert callers, "the per-worker API is called somewhere: this check looks in the wrong place"


def test_no_module_is_over_400_lines():
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, over
