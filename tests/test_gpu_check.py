"""benchmarks/gpu_check.sh --dry-run, as shipped: the GPU check's code paths on CPU at toy
size (our loop and the plain one, a sharded Llama, the demo stopped and resumed), one JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.own_ray
def test_gpu_check_dry_run_writes_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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
