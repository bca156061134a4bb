"""The notebooks run top to bottom in a fresh Jupyter kernel exactly as committed, in their own
folder as Jupyter runs them, and are committed without outputs.

Nothing is injected: the one switch is the environment variable each notebook documents,
`RAYTRAIN_LM_NOTEBOOK_SMALL=1`, which makes it a smoke test of a tiny model. The folder is a
copy of notebooks/ in a folder standing for the checkout, with the repository's experiments/
beside it, so every relative path in a notebook (`../runs`, `../data`,
`sqlite:///../mlflow.db`, `../experiments/...`) names what it names in the repository (the
checkout's own runs, prepared data and MLflow store, shared with the CLI), and what the
notebook writes stays in the test's temporary folder.

What a notebook prints is checked as a user reads it: the lines it promises, and none of the
noise that Ray prints around a run in a notebook (`assert_quiet`; raytrain_lm/console.py).

Each kernel is its own process with its own Ray: a local one for the quickstart and the sweep
(never the test session's, hence `own_ray`), a multi-node `LocalCluster` for the elastic
notebook (hence `chaos`). Both kinds run in the second pytest process of `make test`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from support.noise import RAY_NOISE

from raytrain_lm.clusters.multinode import segments

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "raytrain-lm-tests"
SMALL = "RAYTRAIN_LM_NOTEBOOK_SMALL"
INHERITED = ("RAY_ADDRESS", "RAY_DEDUP_LOGS")  # not passed on to a kernel (see run_notebook)


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


@pytest.fixture(scope="module")
def notebooks_dir(tmp_path_factory) -> Path:
    """A copy of notebooks/ (the notebooks and the files they read), experiments/ beside it.
    One for the three, as a user runs them: they share the prepared data and the store."""
    root = tmp_path_factory.mktemp("checkout")
    folder = root / "notebooks"
    folder.mkdir()
    for file in [*NOTEBOOKS, *(ROOT / "notebooks").glob("*.yaml")]:
        shutil.copy(file, folder)
    (root / "experiments").symlink_to(ROOT / "experiments")
    return folder


def run_notebook(folder: Path, name: str, timeout: int = 600):
    """Executes `folder/name` as it is, in `folder`, with the small switch on; returns the
    executed notebook (a failing cell raises CellExecutionError) and leaves it in `folder`."""
    nb = nbformat.read(folder / name, as_version=4)
    # The test session's Ray exports its address; a kernel that inherited it would join it.
    # conftest's RAY_DEDUP_LOGS is for that Ray: the kernel prints as a user's would.
    env = {k: v for k, v in os.environ.items() if k not in INHERITED} | {SMALL: "1"}
    client = NotebookClient(
        nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(folder)}}
    )
    try:
        client.execute(env=env)
    finally:
        # The executed copy, outputs and cell timings included, for reading after a failure.
        nbformat.write(nb, folder / name)
    return nb


def outputs_text(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
            if parts[-1] == "<IPython.core.display.HTML object>":  # shown as its HTML
                parts.append(out.data.get("text/html", ""))
    return "".join(parts)


# What a notebook must not print (see raytrain_lm/console.py): Ray's and tqdm's hints about
# ipywidgets, colour codes, Ray's C++ log lines, Ray Data's log of its executions.
NOISE = {
    "tqdm's ipywidgets warning": re.compile(r"IProgress not found"),
    "Ray's ipywidgets hint": re.compile(r"Missing packages"),
    "an ANSI escape code": re.compile(r"\x1b\["),
    "a core_worker log line": re.compile(
        r"^\(.*\) .*core_worker|core_worker\.cc|E\d{4} |\d\d,\d{3} E \d+ \d+\]", re.M
    ),
    "Ray Data's execution log": re.compile(
        r"Execution plan of Dataset|Starting execution of Dataset|execution finished in"
        r"|Progress bars disabled"
    ),
    # In a notebook Tune draws its status as HTML.
    "Tune's status table": re.compile(r"Current time:|Trial name|== Status =="),
    "Tune's log of its state files": re.compile(r"Wrote the latest version of all result"),
    **RAY_NOISE,
}
REPEATS = 3  # a line printed this often, word for word, is noise (a log per process or task)


def shown_lines(cell) -> list[str]:
    """The lines Jupyter shows of a cell's printed output: consecutive writes to one stream
    joined, as Jupyter joins them, and a carriage return overwriting its line (a text
    progress bar shows its last state)."""
    streams: list[list[str]] = []  # [name, text]
    for output in cell.outputs:
        if output.output_type != "stream":
            streams.append(["", ""])  # a result or a plot between: no longer consecutive
        elif streams and streams[-1][0] == output.name:
            streams[-1][1] += output.text
        else:
            streams.append([output.name, output.text])
    return [
        ([part for part in line.split("\r") if part] or [""])[-1]
        for _, text in streams
        for line in text.split("\n")
    ]


def assert_quiet(nb, repeats: int | None = REPEATS) -> None:
    """No cell of the executed `nb` printed noise, and the notebook no line `repeats` times
    (None: lines may repeat)."""
    problems, counts = [], Counter()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for what, pattern in NOISE.items():
            if found := pattern.search(outputs_text(cell)):
                problems.append(f"cell {i} printed {what}: {found.string[found.start() :][:200]!r}")
        counts.update(line.strip() for line in shown_lines(cell) if len(line.strip()) >= 10)
    if repeats is not None:
        problems += [
            f"printed {n} times: {line[:200]!r}" for line, n in counts.items() if n >= repeats
        ]
    assert not problems, "\n".join(problems)


def cell_with(nb, source: str):
    return next(c for c in nb.cells if c.cell_type == "code" and source in c.source)


def has_image(cell) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.outputs)


def tracking_uri(run_dir: Path) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["tracking_uri"]


def checkout_store(notebooks_dir: Path) -> str:
    """The store `raytrain-lm train` in the checkout logs to, which the README's `mlflow ui`
    opens: the notebooks' runs must land there too."""
    return f"sqlite:///{notebooks_dir.parent / 'mlflow.db'}"


def assert_nothing_written_beside_the_notebooks(notebooks_dir: Path) -> None:
    """Runs, data and stores of their own in notebooks/ would be a second place for results."""
    strays = [p.name for p in notebooks_dir.iterdir() if p.name in ("runs", "data", "mlruns")]
    strays += [p.name for p in notebooks_dir.glob("*.db")]
    assert not strays, f"written in notebooks/ instead of the checkout: {strays}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs_and_document_the_small_switch(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: exactly one cell must be tagged `parameters`"
    assert SMALL in params[0].source, f"{path.name}: the parameters cell ignores {SMALL}"
    told = [c for c in nb.cells if c.cell_type == "markdown" and f"{SMALL}=1" in c.source]
    assert told, f"{path.name}: no markdown cell tells what {SMALL}=1 does"


def test_every_notebook_is_tested():
    names = {p.name for p in NOTEBOOKS}
    assert names == {"01_quickstart.ipynb", "02_sweeps.ipynb", "03_elastic.ipynb"}


def test_make_notebooks_opens_them_in_jupyterlab_on_this_venvs_kernel(monkeypatch):
    """`make notebooks` (what the README says) installs the `notebooks` extra, JupyterLab, and
    opens the quickstart with the checkout as the server's root (the notebooks show
    ../docs/images); the kernel the notebooks name is this venv's Python, whatever `python3`
    kernelspec a user has elsewhere."""
    from jupyter_client.kernelspec import KernelSpecManager

    extra = re.search(r"^notebooks = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra and '"jupyterlab' in extra.group(1), "no `notebooks` extra with JupyterLab"
    planned = subprocess.run(
        ["make", "-n", "-B", "notebooks"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert '-e ".[dev,notebooks]"' in planned, planned
    launch = planned[planned.index("JUPYTER_PATH=") :]
    jupyter_path = re.match(r'JUPYTER_PATH="([^"]+)"', launch).group(1)
    assert Path(jupyter_path) == Path(sys.prefix) / "share" / "jupyter"
    assert "--ServerApp.root_dir=." in launch and "notebooks/01_quickstart.ipynb" in launch
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    for path in NOTEBOOKS:
        kernel = nbformat.read(path, as_version=4).metadata.kernelspec.name
        spec = KernelSpecManager().get_kernel_spec(kernel)
        assert Path(spec.resource_dir).is_relative_to(sys.prefix), (path.name, spec.resource_dir)
        # jupyter_client starts a spec's bare `python` as its own interpreter: this venv's
        assert spec.argv[0] in ("python", sys.executable), spec.argv


def test_the_sweep_file_shown_is_the_one_the_sweeps_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "02_sweeps.ipynb", as_version=4)
    shown = next(c.source for c in nb.cells if c.source.startswith("## The sweep file"))
    block = re.search(r"```yaml\n(.*?)```", shown, re.S).group(1)
    assert '"../experiments/sweeps/lr_width.yaml"' in cell_with(nb, "SWEEP_FILE =").source
    assert block == (ROOT / "experiments" / "sweeps" / "lr_width.yaml").read_text()


@pytest.mark.own_ray
def test_quickstart(kernel, notebooks_dir):
    nb = run_notebook(notebooks_dir, "01_quickstart.ipynb")
    assert_quiet(nb)
    started = outputs_text(cell_with(nb, "ray.init("))
    assert "Started a local Ray instance. View the dashboard at http" in started, started
    prepared = outputs_text(cell_with(nb, "prepare(cfg.data)"))
    assert re.search(r"^\.\./data/\w+: [\d,]+ train / [\d,]+ val tokens$", prepared, re.M), prepared
    steps = 12
    trained = outputs_text(cell_with(nb, "raytrain_lm.train("))
    assert f"{steps}/{steps} | loss" in trained, "no live progress line in the training cell"
    assert f"'steps': {steps}" in trained
    # Ray Train's workers run elsewhere: a relative store must still be this folder's.
    assert "dropped metrics" not in trained, trained
    run_dir = notebooks_dir.parent / "runs" / "quickstart"
    assert tracking_uri(run_dir) == checkout_store(notebooks_dir)
    assert has_image(cell_with(nb, "plt.subplots")), "the loss plot was not displayed"
    # What the README says to run in the checkout, and the link to the training view.
    look = outputs_text(cell_with(nb, "where_to_look("))
    assert re.fullmatch(
        r"MLflow: `mlflow ui --backend-store-uri sqlite:///mlflow\.db`, then open "
        r"http://127\.0\.0\.1:5000/#/experiments/\d+/runs\?workflowType=machine_learning"
        r"&compareRunsMode=CHART&viewStateShareKey=training\n",
        look,
    ), look
    sample = outputs_text(cell_with(nb, "raytrain_lm.sample("))
    assert sample.startswith("def ") and len(sample) > len("def ")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["mlflow_run_id"]
    assert (notebooks_dir.parent / "data").is_dir(), "the prepared data is not the checkout's"
    assert_nothing_written_beside_the_notebooks(notebooks_dir)


@pytest.mark.own_ray
def test_sweeps(kernel, notebooks_dir):
    nb = run_notebook(notebooks_dir, "02_sweeps.ipynb")
    assert_quiet(nb)
    table = cell_with(nb, "pd.json_normalize").outputs[0].data["text/plain"]
    assert len(re.findall(r"^\d+\s+\w+_\d{5}\s", table, re.M)) == 2, table  # one row a trial
    assert "optim.lr" in table and "model.n_embd" in table, table
    assert has_image(cell_with(nb, "plot.scatter")), "val loss against the swept keys: no plot"
    assert has_image(cell_with(nb, "metric_history(")), "trial curves: no plot"
    best = outputs_text(cell_with(nb, "raytrain_lm.sample("))
    assert re.match(r"best trial \S+: val loss \d", best) and "\ndef " in best, best
    sweep = json.loads((notebooks_dir.parent / "runs" / "small-sweep" / "sweep.json").read_text())
    assert sweep["tracking_uri"] == checkout_store(notebooks_dir)
    assert_nothing_written_beside_the_notebooks(notebooks_dir)


@pytest.mark.chaos
def test_elastic(kernel, notebooks_dir):
    nb = run_notebook(notebooks_dir, "03_elastic.ipynb", timeout=900)
    # A node is killed on purpose: Ray reports it, as any node loss, with the raylet's last log
    # lines (some alike) and the workers' errors. That report stays; the noise must not.
    assert_quiet(nb, repeats=None)
    (run_dir,) = (notebooks_dir.parent / "runs").glob("elastic-*")
    sizes = [s["world_size"] for s in segments(run_dir)]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    ledger = outputs_text(cell_with(nb, "read_ledger(run_dir)"))
    assert "repeated: 0, skipped: 0" in ledger, ledger
    assert has_image(cell_with(nb, "twinx()")), "loss and world size: no plot"
    assert tracking_uri(run_dir) == checkout_store(notebooks_dir)
    assert_nothing_written_beside_the_notebooks(notebooks_dir)
