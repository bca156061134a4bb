"""The GPU checks' dry runs, as shipped: benchmarks/gpu_check.sh (no Ray: what the lent GPU
machine runs) and benchmarks/gpu_check_ray.py (the Ray Train end to end), on CPU at toy size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = (
    "a_gpt2_124m",
    "b_llama_fsdp",
    "c_checkpoint",
    "d_llama_hsdp",
    "e_llama_tensor_parallel",
)


def _run(command: list[str], tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_gpu_check_dry_run_runs_our_step_without_ray(tmp_path):
    """Our step, compiled, against the plain loop; FSDP2; a DCP checkpoint restored into a
    fresh model whose next 25 steps equal the uninterrupted run's; no host waits at steady
    steps; hsdp on its 1 x 1 mesh, blocks compiled, with FSDP2's losses; tensor parallelism
    skipped, saying why, in one process; nothing imported that the lent GPU machine lacks (no
    Ray, no MLflow)."""
    out = tmp_path / "gpu_check.json"
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    done = _run(["bash", script, "--dry-run", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True and results["device"] == "cpu"
    assert results["unexpected_imports"] == []
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert [line.split(":")[1].strip() for line in lines[:5]] == list(PARTS)  # one line each

    a = results["a_gpt2_124m"]
    assert a["compiled"] is True and a["bf16"] is False and a["steps"] == 6
    assert a["ours"]["tokens_per_s"] > 0 and a["plain_loop"]["tokens_per_s"] > 0
    assert 0 < a["ours"]["mfu"] <= 1 and a["ours_over_plain"] > 0

    b = results["b_llama_fsdp"]
    assert b["steps"] == 4 and 0 < b["mfu"] <= 1 and b["params_M"] > 0
    assert b["mesh"] == "fsdp: mesh 1 (shard)"

    d = results["d_llama_hsdp"]
    assert d["mesh"] == "hsdp: mesh 1 (replicate) x 1 (shard)" and d["compiled"] is True
    assert d["ok"] and d["steps"] == 4 and 0 < d["mfu"] <= 1
    assert d["loss_gap_to_fsdp"] <= 1e-4  # (b)'s batches from the same weights

    e = results["e_llama_tensor_parallel"]
    assert "tensor_parallel=2 needs" in e["skipped"] and "runs 1" in e["skipped"]

    c = results["c_checkpoint"]
    assert c["ok"] and c["restored_from"] == "checkpoint_000025" and c["restored_step"] == 25
    assert c["resumed_loss_gap"] <= 1e-5
    syncs = c["host_syncs_at_steady_steps"]
    assert syncs["ours"] == 0 and syncs["steps"] == 47 + 22  # both runs' steps after warm-up


def test_gpu_check_dry_run_on_two_ranks_runs_hsdp_and_tensor_parallelism(tmp_path):
    """`--nproc-per-node 2` (torchrun, gloo): hsdp on 2 replicas x shard groups of half the
    ranks, and llama's blocks split over a tensor-parallel pair beneath fsdp; both take (b)'s
    batches from the same weights and give its losses."""
    out = tmp_path / "gpu_check.json"
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    command = ["bash", script, "--dry-run", "--out", str(out), "--parts", "b,d,e"]
    done = _run([*command, "--nproc-per-node", "2"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["world_size"] == 2 and results["unexpected_imports"] == []
    assert "a_gpt2_124m" not in results and "c_checkpoint" not in results
    assert results["b_llama_fsdp"]["mesh"] == "fsdp: mesh 2 (shard)"
    d, e = results["d_llama_hsdp"], results["e_llama_tensor_parallel"]
    assert d["mesh"] == "hsdp: mesh 2 (replicate) x 1 (shard)"
    assert e["mesh"] == "fsdp: mesh 1 (shard) x 2 (tensor)"
    for part in (d, e):
        assert part["ok"] and part["steps"] == 4 and 0 < part["mfu"] <= 1
        assert part["loss_gap_to_fsdp"] <= 1e-4, part


def test_what_passes(monkeypatch):
    """(c) must have run and held; a part skipped for want of GPUs passes, one in error or
    whose losses strayed does not; `--parts` takes names or letters."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import _chosen, _passed

    assert not _passed("c_checkpoint", {"skipped": "past the 360 s budget"})
    assert _passed("c_checkpoint", {"ok": True}) and not _passed("c_checkpoint", {"ok": False})
    assert _passed("e_llama_tensor_parallel", {"skipped": "tensor_parallel=2 needs ..."})
    assert not _passed("d_llama_hsdp", {"ok": False}) and _passed("b_llama_fsdp", {})
    assert not _passed("b_llama_fsdp", {"error": "RuntimeError: NCCL"})
    assert _chosen("d_llama_hsdp", "b,d") and _chosen("d_llama_hsdp", "d_llama_hsdp")
    assert not _chosen("c_checkpoint", "b, d") and _chosen("c_checkpoint", None)


def test_gpu_check_says_so_when_no_gpu_is_there(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = _run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(out)], tmp_path)
    assert done.returncode == 2
    assert "no CUDA GPU is visible" in done.stderr and "--dry-run" in done.stderr
    assert json.loads(out.read_text())["error"] == "no CUDA GPU is visible: nothing measured"


def test_the_import_check_would_see_ray(monkeypatch):
    """The dry run's import check can fail: in this process (which has Ray and MLflow) it
    names them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import mlflow  # noqa: F401
    import ray  # noqa: F401
    from gpu_check import unexpected_imports

    assert {"ray", "mlflow"} <= set(unexpected_imports())


def test_the_package_imports_nothing_heavy():
    """`import raytrain_lm` (and the model) where Ray, MLflow and pydantic may be missing."""
    probe = (
        "import sys, raytrain_lm, raytrain_lm.model, raytrain_lm.llama; "
        "print(sorted(m for m in ('ray', 'mlflow', 'pydantic', 'pyarrow', 'pandas') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    import raytrain_lm
    import raytrain_lm.text_eval  # noqa: F401  (a submodule named like an API function shadowed it)

    assert callable(raytrain_lm.evaluate) and raytrain_lm.evaluate.__module__ == "raytrain_lm.api"


@pytest.mark.own_ray
def test_gpu_check_ray_dry_run_writes_its_figures(tmp_path):
    out = tmp_path / "gpu_check_ray.json"
    script = str(ROOT / "benchmarks" / "gpu_check_ray.py")
    done = _run([sys.executable, script, "--dry-run", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True and results["device"] == "cpu"

    a = results["a_gpt2_124m"]
    assert a["ours"]["steps"] == 10 and a["ours"]["tokens_per_s"] > 0
    assert a["plain_loop"]["tokens_per_s"] > 0 and a["ours_over_plain"] > 0
    assert 0 < a["ours"]["mfu"] <= 1 and a["compiled"] is False and a["bf16"] is False

    b = results["b_llama_fsdp"]
    assert b["steps"] == 6 and 0 < b["mfu"] <= 1 and b["params_M"] > 0

    c = results["c_demo"]
    assert c["ok"] and c["backend"] == "gloo"
    assert c["steps"] == 6 and c["restored_steps"] == [0, 3]
    assert c["host_syncs_in_hot_path"] == 0
