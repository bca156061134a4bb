"""Replica groups (`scaling.fault_tolerance=replicas`) on the session's Ray, with no incident:
the same steps as the suite's 2-worker DDP run, and a sweep trial on them. The incidents (nodes killed, added, drained)
are test_replicas.py's, on a multi-node Ray of their own (the chaos process of `make test`)."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient
from support.step_losses import assert_same_step_losses
from support.sweep_files import write_sweep

import raytrain_lm
from raytrain_lm.checkpoints import complete_checkpoints, read_state
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.run_events.journal import read_events


def test_two_groups_take_ddps_steps_spend_their_budget_and_resume_exactly(
    world_size_runs, s3, monkeypatch
):
    """Two replica groups (one worker each, a quorum every step), their run in a bucket, at
    $3,600/h each with a $10 budget and paced at 0.5 s a step: the chief keeps the spend and
    stops both groups at one step with a checkpoint (`stopped: "budget"`, the stop event says
    why); the same budget is then refused before any group starts, and a larger one resumes
    from that checkpoint: every step's loss equals the 2-worker DDP run's within 1e-5 (fp32;
    the gradients are reduced by torchft, not DDP), the ledger holds every position once, each
    step is logged once by one writer, and the checkpoints are those of a DDP run. The
    checkpoint interval is `auto`: the chief chooses it, and it travels to the other group."""
    from raytrain_lm.errors import UserError
    from raytrain_lm.trainer import chaos

    common, reference = world_size_runs["common"], world_size_runs["reference"]
    steps = reference["steps"]
    bucket = s3.new_bucket()
    overrides = [
        *common,
        f"output_dir={bucket}/runs",
        "name=replicas",
        "scaling.fault_tolerance=replicas",
        "scaling.num_workers=2",
        "fault.price_per_hour.cpu=3600",
        "fault.preemption_check_s=0.2",
        "checkpoint.every_steps=auto",  # the first at step 3 (a quarter of the run), as 3 was
    ]
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.5")
    stopped = raytrain_lm.train(load_config(None, [*overrides, "budget.max_usd=10"]), sample=False)
    spent_at = stopped["steps"]
    assert stopped["stopped"] == "budget" and 1 <= spent_at < steps, stopped
    assert stopped["goodput"]["cost_total"] >= 10
    monkeypatch.delenv(chaos.ENV_VAR)
    with pytest.raises(UserError, match=r"has spent \$[0-9.,]+ of budget.max_usd=\$10.00: raise"):
        raytrain_lm.train(load_config(None, [*overrides, "budget.max_usd=10"]), sample=False)
    summary = raytrain_lm.train(
        load_config(None, [*overrides, "budget.max_usd=1000"]), sample=False
    )
    assert summary["steps"] == steps and not summary["stopped"]

    run_dir = f"{bucket}/runs/replicas"
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))
    events = read_events(run_dir)
    (stop,) = [e for e in events if e["event"] == "stop"]
    assert stop["why"] == "budget" and stop["step"] == spent_at
    starts = [e for e in events if e["event"] == "replica_start"]
    assert sorted((e["step"], e["group"]) for e in starts) == [
        (0, 0), (0, 1), (spent_at, 0), (spent_at, 1)
    ]  # fmt: skip
    # The chief chose the interval after a checkpoint, and every group read at its steps:
    # the checkpoints are the chosen ones, the budget's and the last.
    (chosen, *_) = [e for e in events if e["event"] == "checkpoint_interval"]
    assert chosen["step"] % 3 == 0 and chosen["steps"] >= 1, chosen
    checkpointed = sorted(read_state(c).step for c in complete_checkpoints(run_dir))
    assert checkpointed[-1] == steps, checkpointed
    assert all(s % 3 == 0 or s == spent_at for s in checkpointed), checkpointed
    assert summary["goodput"]["steps_recomputed"] == 0  # stopped at a checkpoint
    assert summary["goodput"]["cost_total"] > stopped["goodput"]["cost_total"]
    # Both groups' type and price reach the chief in every step's sum (roster.py).
    assert summary["per_type"]["cpu"]["workers"] == 2, summary["per_type"]
    assert summary["per_type"]["cpu"]["usd_per_mtok"] > 0
    priced = [e for e in events if e["event"] == "replica_price"]
    by_segment = {e["segment"]: (e["price_per_hour"], e["types"]) for e in priced}
    assert list(by_segment.values()) == [(7200, ["cpu", "cpu"])] * 2  # each run's latest
    assert {e["price_per_hour"] for e in priced} <= {3600, 7200}  # one group, until both

    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    assert_same_step_losses(uri, summary["mlflow_run_id"], reference["mlflow_run_id"], steps)
    # The chief's account as metrics (chief_stops.py), over both invocations.
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(summary["mlflow_run_id"], "cost/spent")
    spent = [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
    assert spent and spent[-1] >= 10 and spent == sorted(spent), spent
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-4)


def test_groups_of_different_speeds_take_shares_by_their_measured_speeds(
    world_size_runs, monkeypatch
):
    """`scaling.balance=auto` with replica groups: group 1's simulated device runs at half the
    speed of group 0's (chaos.py's device-time). Each group times its own forwards after a
    warm-up and declares its speed in the step's agreement; once both have, every group takes
    the shares their speeds give (about 2:1), the chief records the plan, and the steps'
    losses are still the 2-worker DDP run's within 1e-5 (the update does not depend on the
    shares), with every position in the ledger once."""
    from raytrain_lm.trainer import chaos

    common, reference = world_size_runs["common"], world_size_runs["reference"]
    steps = reference["steps"]
    overrides = [
        *common,
        "name=replicas-balanced",
        "scaling.fault_tolerance=replicas",
        "scaling.num_workers=2",
        "scaling.balance=auto",
    ]
    # 20 ms per sequence forward and 40 ms backward on group 0, twice that on group 1: the
    # host's own few ms per sequence pull the measured ratio below 2:1 (test_balance.py).
    monkeypatch.setenv(chaos.ENV_VAR, "device-time:seconds=0.02:rank=1:factor=2")
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    assert summary["steps"] == steps and not summary["stopped"]

    run_dir = world_size_runs["output_dir"] / "replicas-balanced"
    events = read_events(run_dir)
    plans = [e for e in events if e["event"] == "batch_plan"]
    # Both groups measure steps 3-7 (after the warm-up of steps 0-2) and declare at step 8.
    assert len(plans) == 1 and 8 <= plans[0]["step"] < steps, plans
    assert plans[0]["groups"] == [0, 1]
    fast, slow = plans[0]["sequences_per_s"]
    assert 1.4 <= fast / slow <= 2.4, plans
    shares = plans[0]["shares"]
    assert sum(shares) == 12 and shares[0] in (7, 8, 9), plans  # about 2:1 of 12
    assert summary["shares"] == shares
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))

    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    assert_same_step_losses(uri, summary["mlflow_run_id"], reference["mlflow_run_id"], steps)
    history = raytrain_lm.metric_history("replicas-balanced", world_size_runs["output_dir"])
    assert history["plan/rank0_share"].dropna().to_dict()[plans[0]["step"]] == shares[0]


@pytest.mark.beside
def test_a_sweep_trial_on_replica_groups_reports_every_checkpoint_to_tune(
    ray_session, tiny_overrides, tmp_path
):
    """Ray Train's reports wait for every worker, which replica groups cannot promise: their
    chief hands each checkpoint's report to the trial's queue itself. Tune sees the val loss
    at steps 2, 4 and 6, each with a Tune checkpoint that points at the trial's checkpoint."""
    path = write_sweep(
        tmp_path,
        [*tiny_overrides, "scaling.fault_tolerance=replicas", "scaling.num_workers=2"],
        name="groups",
        num_samples=1,
        scheduler="fifo",
    )
    summary = raytrain_lm.sweep(path)
    assert summary["trials"] == 1 and summary["errored"] == 0, summary
    results = list((tmp_path / "runs" / "groups").rglob("result.json"))
    assert len(results) == 1, results
    reports = [json.loads(line) for line in results[0].read_text().splitlines()]
    by_step = [r for r in reports if not r.get("done_steps")]
    assert [r["step"] for r in by_step] == [2, 4, 6], reports
    assert all(r["val_loss"] > 0 for r in by_step)
    pointers = list(results[0].parent.rglob("train_checkpoint.json"))
    steps = sorted(json.loads(p.read_text())["checkpoint"].rsplit("_", 1)[1] for p in pointers)
    assert steps[:3] == ["000000002", "000000004", "000000006"], steps
