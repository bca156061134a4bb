"""Sweep files: what `load_sweep` refuses (one line naming the key) and what it builds (search
spaces, schedulers, searchers), without starting a trial."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.sweep_files import write_sweep

from raytrain_lm.errors import UserError
from raytrain_lm.sweeps import load_sweep, log_uniform_keys
from raytrain_lm.sweeps.search import build_scheduler, build_search_alg, param_space

pytestmark = pytest.mark.no_ray

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments" / "sweeps").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_sweep_file_parses(path):
    sweep = load_sweep(path)
    assert sweep.spec.space and sweep.name
    assert sweep.base["checkpoint"]["every_steps"] % sweep.base["training"]["eval_every"] == 0


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (
            {"optim.lrr": {"uniform": [0.1, 0.2]}},
            "unknown key 'optim.lrr'; did you mean 'optim.lr'",
        ),
        ({"modle.n_embd": {"choice": [32]}}, "unknown key 'modle.n_embd'; did you mean 'model'"),
        ({"optim": {"choice": [1]}}, "'optim' is a section"),
        ({"optim.lr": {"between": [1, 2]}}, "expected one of choice, grid"),
        ({"optim.lr": {"loguniform": [0, 1]}}, "loguniform needs low > 0"),
        ({"optim.lr": {"uniform": [2, 1]}}, "low < high"),
        ({"model.n_embd": {"choice": [32, 33]}}, "must be divisible by model.n_head"),
        ({"training.precision": {"grid": ["fp32", "fp64"]}}, "'training.precision'"),
    ],
)
def test_bad_search_spaces_are_refused_naming_the_key(tmp_path, space, message):
    path = write_sweep(tmp_path, ["model.n_head=2"], space=space)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_sweep(path)


def test_either_fault_tolerance_may_be_swept(tmp_path):
    space = {"scaling.fault_tolerance": {"choice": ["restart", "replicas"]}}
    sweep = load_sweep(write_sweep(tmp_path, ["scaling.num_workers=2"], space=space))
    assert sweep.spec.space == space


def test_sweep_file_typos_get_did_you_mean_and_exit_2(tmp_path):
    path = write_sweep(tmp_path, [], scheduler={"kind": "asha", "grace_periode": 2})
    with pytest.raises(UserError, match="did you mean 'scheduler.grace_period'"):
        load_sweep(path)
    # config.format_validation_error words the sweep file's problems as it does a config's
    spaceless = tmp_path / "spaceless.yaml"
    spaceless.write_text(yaml.safe_dump({"num_samples": 2}))
    with pytest.raises(UserError, match=f"^{spaceless}: missing 'space'$"):
        load_sweep(spaceless)
    with pytest.raises(UserError, match=r"invalid value for 'num_samples': .* \(got 0\)$"):
        load_sweep(write_sweep(tmp_path, [], num_samples=0))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"spaces": {}, "space": {"optim.lr": {"choice": [1e-3]}}}))
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", "sweep", str(bad)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"raytrain-lm: error: {bad}: unknown key 'spaces'; did you mean 'space'?"
    ]


def test_keys_sampled_log_uniformly_are_found_in_space_and_pbt_mutations():
    record = {
        "space": {"optim.lr": {"loguniform": [3e-4, 3e-3]}, "model.n_embd": {"choice": [64]}},
        "scheduler": {"hyperparam_mutations": {"optim.weight_decay": {"loguniform": [1e-3, 1]}}},
    }
    assert log_uniform_keys(record) == {"optim.lr", "optim.weight_decay"}


def test_pbt_sweep_files_are_checked(tmp_path):
    def pbt(**scheduler):
        return write_sweep(tmp_path, [], scheduler={"kind": "pbt", **scheduler})

    with pytest.raises(UserError, match="pbt needs hyperparam_mutations"):
        load_sweep(pbt())
    with pytest.raises(UserError, match="PBT cannot change 'model.n_embd' mid-run"):
        load_sweep(pbt(hyperparam_mutations={"model.n_embd": {"choice": [32, 48]}}))
    with pytest.raises(UserError, match=r"perturbation_interval \(3\) must be a multiple"):
        load_sweep(
            pbt(perturbation_interval=3, hyperparam_mutations={"optim.lr": {"choice": [1e-3]}})
        )
    with pytest.raises(UserError, match="need kind: pbt"):
        load_sweep(write_sweep(tmp_path, [], scheduler={"perturbation_interval": 2}))
    with pytest.raises(UserError, match="compares trials at their checkpoints: give checkpoint"):
        load_sweep(write_sweep(tmp_path, ["checkpoint.every_steps=auto"]))
    sweep = load_sweep(
        pbt(hyperparam_mutations={"optim.warmup_steps": {"randint": [2, 10]}}, synch=True)
    )
    scheduler = build_scheduler(sweep)
    assert scheduler._perturbation_interval == 2 and scheduler._synch
    # a perturbation (x0.8 or x1.2) stays inside the declared range, and an int stays an int
    explore = scheduler._custom_explore_fn
    assert explore({"optim.warmup_steps": 14}) == {"optim.warmup_steps": 9}
    assert explore({"optim.warmup_steps": 1}) == {"optim.warmup_steps": 2}


def test_optuna_search_samples_the_space(tmp_path):
    path = write_sweep(tmp_path, [], search="optuna", seed=3)
    sweep = load_sweep(path)
    searcher = build_search_alg(sweep)
    searcher.set_search_properties("val_loss", "min", param_space(sweep.spec.space))
    suggested = searcher.suggest("t1")
    assert 1e-3 <= suggested["optim.lr"] <= 1e-2 and suggested["model.n_embd"] in (32, 48)
    with pytest.raises(UserError, match="optuna cannot sample grid keys"):
        load_sweep(write_sweep(tmp_path, [], search="optuna", space={"optim.lr": {"grid": [1e-3]}}))
    assert param_space({"x.y": {"grid": [1, 2]}}) == {"x.y": {"grid_search": [1, 2]}}
