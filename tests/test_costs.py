"""Cost planning (raytrain_lm/costs/): the expected-time model against a Monte Carlo simulation
of Poisson interruptions, its properties, the catalog as shipped and as misspelt, and
`raytrain-lm plan` as a user types it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raytrain_lm.config import load_config
from raytrain_lm.config.durations import parse_duration_h
from raytrain_lm.costs import plan
from raytrain_lm.costs.catalog import DEFAULT_CATALOG, load_catalog
from raytrain_lm.costs.model import best_interval_s, expected_wall_s, young_daly_interval_s
from raytrain_lm.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = ROOT / "experiments" / "llama_1b_fsdp.yaml"


def simulate_wall_s(work, interval, checkpoint, rate, recovery, runs, seed=0) -> np.ndarray:
    """Wall times of `runs` runs: segments of `interval` of work then a checkpoint, each
    attempt cut short by an exponential time to interruption, then `recovery`."""
    rng = np.random.default_rng(seed)
    segments, last = divmod(work, interval)
    sizes = [interval + checkpoint] * int(segments) + ([last + checkpoint] if last else [])
    walls = np.zeros(runs)
    for r in range(runs):
        for size in sizes:
            while True:
                until = rng.exponential(1 / rate)
                if until >= size:
                    walls[r] += size
                    break
                walls[r] += until + recovery
    return walls


def test_the_closed_form_matches_a_monte_carlo_simulation():
    """10 h of work, checkpoints of 2 min every hour, an interruption every 5 h on average,
    10 min to come back: the mean of 4,000 simulated runs is the formula's within 3 standard
    errors (the work is a whole number of intervals, as the formula assumes)."""
    work, interval, checkpoint, rate, recovery = 36_000, 3_600, 120, 1 / 18_000, 600
    walls = simulate_wall_s(work, interval, checkpoint, rate, recovery, runs=4_000)
    expected = expected_wall_s(work, interval, checkpoint, rate, recovery)
    error = walls.std() / math.sqrt(len(walls))
    assert abs(walls.mean() - expected) < 3 * error, (walls.mean(), expected, error)
    assert expected > work + 10 * checkpoint  # interruptions cost more than checkpoints alone


def test_cost_rises_with_the_interruption_rate_and_without_any_is_the_work():
    work, checkpoint, recovery = 36_000, 120, 600
    assert expected_wall_s(work, math.inf, checkpoint, 0.0, recovery) == work
    assert best_interval_s(work, checkpoint, 0.0, recovery) == math.inf  # no checkpoint needed
    walls = []
    for per_hour in (0.0, 0.01, 0.05, 0.2, 1.0):
        rate = per_hour / 3600
        interval = best_interval_s(work, checkpoint, rate, recovery)
        walls.append(expected_wall_s(work, interval, checkpoint, rate, recovery))
    assert walls[0] == work and walls == sorted(walls) and len(set(walls)) == len(walls)


def test_the_recommended_interval_minimises_the_simulated_time():
    """Simulated (not the formula): the recommended interval beats half and twice it, and
    lies near Young/Daly's approximation."""
    work, checkpoint, rate, recovery = 20 * 3600, 300, 1 / (4 * 3600), 600
    best = best_interval_s(work, checkpoint, rate, recovery)
    assert 0.8 < best / young_daly_interval_s(checkpoint, rate, recovery) < 1.25

    def simulated(interval: float) -> float:  # the same draws for each interval
        return simulate_wall_s(work, interval, checkpoint, rate, recovery, runs=1_500).mean()

    at_best = simulated(best)
    assert at_best < simulated(best / 2) and at_best < simulated(best * 2)


def test_the_shipped_catalog_is_dated_sourced_and_misspellings_are_named(tmp_path):
    catalog = load_catalog()
    assert catalog.as_of and "AWS" in catalog.source
    assert {"H100", "A100", "L4"} <= set(catalog.types)
    for kind in catalog.types.values():
        assert kind.spot.usd_per_gpu_hour < kind.on_demand.usd_per_gpu_hour
    misspelt = tmp_path / "prices.yaml"
    misspelt.write_text(DEFAULT_CATALOG.read_text().replace("gpus_per_node: 1", "gpus_pernode: 1"))
    with pytest.raises(
        UserError, match="'types.L4.gpus_pernode'; did you mean 'types.L4.gpus_per_node'"
    ):
        load_catalog(misspelt)
    with pytest.raises(ValueError, match="a duration is a number with d, h or m"):
        parse_duration_h("two days")
    assert parse_duration_h("2d") == 48 and parse_duration_h("90m") == 1.5


def test_a_plan_ranks_candidates_and_marks_the_cheapest_in_time():
    """The 1B llama for 20B tokens in 48 h: the cheapest within the deadline costs no more
    than any other that meets it, everything faster than the deadline is marked so, a 7B
    model is not offered on a device it cannot fit, and no interruptions on on-demand."""
    result = plan(load_config(LLAMA_1B), tokens=20e9, deadline="48h")
    estimates, best = result["estimates"], result["cheapest"]
    assert best is not None and best["wall_h"] <= 48
    # 240 sequences of micro-batches of 4 split over 1, 2 or 4 workers, not 8 or more: a
    # candidate the run would refuse is never offered, however cheap.
    assert {e["workers"] for e in estimates} == {1, 2, 4}
    assert result["batch_does_not_split"] == [8, 16, 32, 64]
    in_time = [e for e in estimates if e["meets_deadline"]]
    assert best["cost_usd"] <= min(e["cost_usd"] for e in in_time) + 0.01
    assert all(e["meets_deadline"] == (e["wall_h"] <= 48) for e in estimates)
    assert all(e["interruptions"] == 0 for e in estimates if e["capacity"] == "on_demand")
    on_demand = [e for e in estimates if e["capacity"] == "on_demand"]
    assert all(e["goodput"] == 1.0 and e["checkpoint_every_steps"] is None for e in on_demand)
    seven_b = plan(load_config(None, ["model.preset=7b", "model.arch=llama"]), tokens=1e9)
    single_l4 = [e for e in seven_b["estimates"] if e["accelerator"] == "L4" and e["workers"] == 1]
    assert not single_l4  # 100 GiB of state on one 24 GB device


def test_plan_from_the_cli_as_typed(tmp_path):
    """`raytrain-lm plan experiments/llama_1b_fsdp.yaml --tokens 20e9 --deadline 48h`: the
    table, the recommendation with its checkpoint interval, what was assumed; `--json` for
    scripts; a bad deadline is one line and exit code 2."""
    command = [sys.executable, "-m", "raytrain_lm.cli", "plan", str(LLAMA_1B)]
    done = subprocess.run(
        [*command, "--tokens", "20e9", "--deadline", "48h"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "20.00B tokens" in out and "cheapest within the deadline:" in out
    assert "checkpoint every" in out and "assumed: MFU 35%" in out
    assert "cheapest within the deadline: 4 x " in out, out
    assert (
        "left out 8, 16, 32, 64 workers: training.global_batch_size (240) does not split over "
        "them as set"
    ) in out
    assert any(line.startswith("*") for line in out.splitlines())
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True)
    result = json.loads(as_json.stdout)
    assert result["tokens"] == 20_000 * 240 * 2048  # max_steps x the global batch
    bad = subprocess.run([*command, "--deadline", "soon"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--deadline: a duration is a number with d, h or m" in bad.stderr


def test_a_plan_calibrated_from_a_run_says_what_it_measured(learned_run, tmp_path):
    """`plan --from learns` on the suite's tracked run (2 CPU workers): the MFU its summary
    measured on type cpu and its checkpoints' save time replace the assumed ones, and the
    plan's tokens/s for 2 cpu workers follows from that MFU; what it did not measure (no
    interruptions, no recovery) stays assumed."""
    import torch

    from raytrain_lm.devices import peak_flops
    from raytrain_lm.run_events.journal import read_events

    catalog = tmp_path / "prices.yaml"
    peak = peak_flops(torch.device("cpu"))
    catalog.write_text(
        "as_of: '2026-12'\nsource: this machine\ntypes:\n"
        f"  cpu: {{memory_gib: 8, peak_tflops: {peak / 1e12}, on_demand: {{usd_per_gpu_hour: 1.0}}}}\n"
    )
    cfg = load_config(None, learned_run["overrides"])
    result = plan(cfg, from_run="learns", catalog_path=catalog, worker_counts=(2,))
    measured = result["inputs"]["measured"]
    assert any(m.startswith("MFU on cpu") for m in measured), measured
    assert any(m.startswith("checkpoint save") for m in measured), measured
    assert not any("interruptions" in m or "recovery" in m for m in measured), measured
    saves = [
        e
        for e in read_events(learned_run["output_dir"] / "learns")
        if e["event"] == "checkpoint_saved"
    ]
    assert [e["step"] for e in saves] == [20, 40] and all(e["save_s"] > 0 for e in saves)
    (estimate,) = result["estimates"]
    mfu = learned_run["summary"]["per_type"]["cpu"]["mfu"]
    expected = 2 * peak * mfu / result["flops_per_token"]
    assert estimate["tokens_per_s"] == pytest.approx(expected, rel=1e-6)


def test_a_run_that_spends_its_budget_checkpoints_ends_and_resumes_exactly(
    world_size_runs, monkeypatch
):
    """budget.max_usd on a real run: 2 CPU workers priced at $3,600/h each, paced at 0.5 s a
    step, with a $14 budget. The spend reaches it mid-run: the group checkpoints at that step
    and ends, `stopped: "budget"`, the spend and projection are in MLflow. Resumed with a
    larger budget, it finishes with every step's loss that of the uninterrupted run and every
    sequence position once. Started again with the same budget, it is refused before any
    worker starts."""
    from mlflow.tracking import MlflowClient

    import raytrain_lm
    from raytrain_lm.data.ledger import read_ledger
    from raytrain_lm.run_events.journal import read_events
    from raytrain_lm.trainer import chaos

    common, straight = world_size_runs["common"], world_size_runs["reference"]
    priced = [*common, "name=budgeted", "scaling.num_workers=2", "fault.price_per_hour={cpu: 3600}",
              "fault.preemption_check_s=0.2"]  # fmt: skip
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.5")
    first = raytrain_lm.train(load_config(None, [*priced, "budget.max_usd=14"]), sample=False)
    assert first["stopped"] == "budget" and 1 <= first["steps"] < 12, first
    run_dir = world_size_runs["output_dir"] / "budgeted"
    (stop,) = [e for e in read_events(run_dir) if e["event"] == "stop"]
    assert stop["why"] == "budget" and stop["step"] == first["steps"]
    assert first["goodput"]["cost_total"] >= 14
    monkeypatch.delenv(chaos.ENV_VAR)
    with pytest.raises(UserError, match=r"has spent \$[0-9.,]+ of budget.max_usd=\$14.00: raise"):
        raytrain_lm.train(load_config(None, [*priced, "budget.max_usd=14"]), sample=False)
    done = raytrain_lm.train(load_config(None, [*priced, "budget.max_usd=1000"]), sample=False)
    assert done["steps"] == 12 and not done["stopped"]
    assert read_ledger(run_dir).tolist() == list(range(12 * 12))
    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    client = MlflowClient(tracking_uri=uri)

    def history(summary: dict, key: str) -> list[tuple[int, float]]:
        metrics = client.get_metric_history(summary["mlflow_run_id"], key)
        return sorted({(m.step, m.value) for m in metrics})

    got, expected = history(done, "train/loss"), history(straight, "train/loss")
    assert [s for s, _ in got] == list(range(1, 13))
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) < 1e-4
    spent, projected = history(first, "cost/spent"), history(first, "cost/projected")
    assert spent[-1][1] >= 14 and projected[-1][1] > 14  # read at the stop
    assert done["goodput"]["cost_total"] > first["goodput"]["cost_total"]
    cpu = done["per_type"]["cpu"]  # two workers at $3600 an hour each
    assert cpu["usd_per_mtok"] == pytest.approx(2 * 3600 / 3600 / cpu["tokens_per_s"] * 1e6)
