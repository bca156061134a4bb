"""The worker's loop (trainer/worker.py) with its components, in this process and without Ray
Train (tests/support/in_process.py): a one-worker static group whose data is read here. It
trains the steps a Ray Train run of two DDP workers trains; a stop request ends its group at
the next step with a checkpoint, and the next group resumes there, every position once."""

from __future__ import annotations

from support.in_process import here_spec, train_here
from support.step_losses import step_losses

from raytrain_lm.checkpoints import complete_checkpoints, read_state
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer.components.stop_requests import clear_stop_request, request_stop


def _reference(world_size_runs) -> tuple[dict[int, float], int]:
    common, reference = world_size_runs["common"], world_size_runs["reference"]
    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    return step_losses(uri, reference["mlflow_run_id"]), reference["steps"]


def _losses(kept) -> dict[int, float]:
    return {step: m["train/loss"] for step, m in kept.steps.items() if "train/loss" in m}


def test_the_loop_here_trains_the_steps_of_a_ray_train_run(world_size_runs):
    """The same 12 steps of 12 sequences as the session's 2-worker Ray Train run: each step's
    loss within 1e-5, checkpoints reported every 3 steps, every position once in the ledger."""
    reference, steps = _reference(world_size_runs)
    spec = here_spec([*world_size_runs["common"], "name=here", "scaling.num_workers=1"])
    kept, ray = train_here(spec)
    ours = _losses(kept)
    assert sorted(ours) == sorted(reference) == list(range(1, steps + 1))
    assert max(abs(ours[s] - reference[s]) for s in ours) < 1e-5
    assert [report["step"] for report in ray.reports] == [3, 6, 9, 12]
    assert read_state(complete_checkpoints(spec.run_dir)[-1]).step == steps
    assert read_ledger(spec.run_dir).tolist() == list(range(steps * 12))
    assert kept.steps[steps]["val/loss"] == ray.reports[-1]["val_loss"]
    # Each checkpoint, once complete, is logged as a model of the run (tracking/models.py)
    models = kept.checkpoint_models
    assert [m.step for m in models] == [3, 6, 9, 12]
    assert [m.location for m in models] == [
        str(spec.run_dir.at(f"checkpoint_{step:09d}")) for step in (3, 6, 9, 12)
    ]
    assert models[-1].losses == {
        "train_loss": ray.reports[-1]["train_loss"],
        "val_loss": ray.reports[-1]["val_loss"],
    }


def test_a_stop_checkpoints_at_once_and_the_next_group_resumes_there(world_size_runs):
    """A stop requested before the first step (asked at every step: no clock decides when):
    the group ends after step 1 with a checkpoint of it and a stop event; the driver clears the
    request, and the next group restores step 1 and trains to the end. Together: the reference
    run's losses, every position once."""
    reference, steps = _reference(world_size_runs)
    overrides = [
        *world_size_runs["common"], "name=here-stopped", "scaling.num_workers=1",
        "fault.preemption_check_s=1e-9",
    ]  # fmt: skip
    spec = here_spec(overrides)
    request_stop(spec.run_dir, "test")
    first, ray = train_here(spec)
    assert sorted(_losses(first)) == [1] and [r["step"] for r in ray.reports] == [1]
    (stop,) = [e for e in read_events(spec.run_dir) if e["event"] == "stop"]
    assert stop["step"] == 1
    clear_stop_request(spec.run_dir)  # as the driver does before it starts the next group

    second, _ = train_here(here_spec(overrides))
    both = _losses(first) | _losses(second)
    assert min(_losses(second)) == 2 and sorted(both) == list(range(1, steps + 1))
    assert max(abs(both[s] - reference[s]) for s in both) < 1e-5
    assert read_ledger(spec.run_dir).tolist() == list(range(steps * 12))
    restored = [
        e["restored_step"] for e in read_events(spec.run_dir) if e["event"] == "segment_start"
    ]
    assert restored == [0, 1]
