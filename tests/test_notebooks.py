"""The notebooks run top to bottom in a fresh Jupyter kernel, with small settings injected
after their `parameters` cell (as papermill does), and are committed without outputs.

Each kernel is its own process with its own Ray: a local one for the quickstart and the sweep
(never the test session's, hence `own_ray`), a multi-node `LocalCluster` for the elastic
notebook (hence `chaos`). Both kinds run in the second pytest process of `make test`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import TINY
from nbclient import NotebookClient

from raytrain_lm.chaos import segments

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "raytrain-lm-tests"
# The live progress line is part of what the quickstart shows: leave it on.
NOTEBOOK_TINY = [o for o in TINY if not o.startswith("training.progress")]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec for this interpreter in a private folder: a `python3` kernelspec elsewhere
    on the machine (a user's) would otherwise win and run another Python."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, prefix=str(prefix), display_name="raytrain-lm tests")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
        yield KERNEL


def run_notebook(name: str, params: dict, cwd: Path, timeout: int = 600):
    """Executes notebooks/`name` in `cwd` with `params` set right after its parameters cell;
    returns the executed notebook (a failing cell raises CellExecutionError) and leaves a copy
    in `cwd`."""
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = "\n".join(f"{key} = {value!r}" for key, value in params.items())
    nb.cells.insert(
        index + 1, nbformat.v4.new_code_cell(injected, metadata={"tags": ["injected-parameters"]})
    )
    # The test session's Ray exports its address; a kernel that inherited it would join it.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    client = NotebookClient(
        nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(cwd)}}
    )
    try:
        client.execute(env=env)
    finally:
        # The executed copy, outputs and cell timings included, for reading after a failure.
        nbformat.write(nb, cwd / name)
    return nb


def outputs_text(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def cell_with(nb, source: str):
    return next(c for c in nb.cells if c.cell_type == "code" and source in c.source)


def has_image(cell) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: exactly one cell must be tagged `parameters`"


def test_every_notebook_is_tested():
    names = {p.name for p in NOTEBOOKS}
    assert names == {"01_quickstart.ipynb", "02_sweeps.ipynb", "03_elastic.ipynb"}


@pytest.mark.own_ray
def test_quickstart(kernel, tmp_path, shared_dirs):
    steps = 12
    nb = run_notebook(
        "01_quickstart.ipynb",
        {
            "NAME": "nb-quickstart",
            "STEPS": steps,
            "OUTPUT_DIR": str(tmp_path / "runs"),
            "TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "OVERRIDES": [
                *NOTEBOOK_TINY,
                f"data.cache_dir={shared_dirs['data']}",
                "training.log_every=4",
                "training.eval_every=6",
            ],
            "SAMPLE_TOKENS": 40,
        },
        tmp_path,
    )
    trained = outputs_text(cell_with(nb, "raytrain_lm.train("))
    assert f"{steps}/{steps} | loss" in trained, "no live progress line in the training cell"
    assert f"'steps': {steps}" in trained
    assert has_image(cell_with(nb, "plt.subplots")), "the loss plot was not displayed"
    sample = outputs_text(cell_with(nb, "raytrain_lm.sample("))
    assert sample.startswith("def ") and len(sample) > len("def ")
    summary = json.loads((tmp_path / "runs" / "nb-quickstart" / "summary.json").read_text())
    assert summary["steps"] == steps and summary["mlflow_run_id"]


@pytest.mark.own_ray
def test_sweeps(kernel, tmp_path, shared_dirs):
    sweep_file = tmp_path / "tiny-sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "name": "nb-sweep",
                "config": {
                    "training": {"max_steps": 6, "eval_every": 2},
                    "checkpoint": {"every_steps": 2},
                    "scaling": {"num_workers": 1},
                },
                "space": {
                    "optim.lr": {"loguniform": [1e-3, 1e-2]},
                    "model.n_embd": {"choice": [32, 48]},
                },
                "num_samples": 2,
                "max_concurrent_trials": 2,
            }
        )
    )
    nb = run_notebook(
        "02_sweeps.ipynb",
        {
            "SWEEP_FILE": str(sweep_file),
            "NUM_CPUS": 5,  # two trials side by side: a worker and a Ray Data CPU each
            "OUTPUT_DIR": str(tmp_path / "runs"),
            "TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "OVERRIDES": [*NOTEBOOK_TINY, f"data.cache_dir={shared_dirs['data']}"],
            "SAMPLE_TOKENS": 40,
        },
        tmp_path,
    )
    table = cell_with(nb, "pd.json_normalize").outputs[0].data["text/plain"]
    assert len(re.findall(r"^\d+\s+\w+_\d{5}\s", table, re.M)) == 2, table  # one row a trial
    assert "optim.lr" in table and "model.n_embd" in table, table
    assert has_image(cell_with(nb, "plot.scatter")), "val loss against the swept keys: no plot"
    assert has_image(cell_with(nb, "metric_history(")), "trial curves: no plot"
    best = outputs_text(cell_with(nb, "raytrain_lm.sample("))
    assert re.match(r"best trial \S+: val loss \d", best) and "\ndef " in best, best
    assert (tmp_path / "runs" / "nb-sweep" / "sweep.json").is_file()


@pytest.mark.chaos
def test_elastic(kernel, tmp_path, shared_dirs):
    run_dir = tmp_path / "runs" / "nb-elastic"
    nb = run_notebook(
        "03_elastic.ipynb",
        {
            "NAME": "nb-elastic",
            "STEPS": 400,  # >= 40 s of steps: long enough to shrink, then grow, mid-run
            "STEP_DELAY_S": 0.1,
            "OUTPUT_DIR": str(tmp_path / "runs"),
            "TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "OVERRIDES": [
                *(o for o in NOTEBOOK_TINY if not o.startswith("training.global_batch_size")),
                f"data.cache_dir={shared_dirs['data']}",
                "training.log_every=50",
                "training.eval_every=100000",
            ],
        },
        tmp_path,
        timeout=900,
    )
    sizes = [s["world_size"] for s in segments(run_dir)]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    ledger = outputs_text(cell_with(nb, "read_ledger(run_dir)"))
    assert "repeated: 0, skipped: 0" in ledger, ledger
    assert has_image(cell_with(nb, "twinx()")), "loss and world size: no plot"
