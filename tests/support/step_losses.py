"""Per-step train losses of MLflow runs, compared step by step (replica groups' tests)."""

from __future__ import annotations

from mlflow.tracking import MlflowClient


def step_losses(tracking_uri: str, run_id: str) -> dict[int, float]:
    """`train/loss` by step; each step logged once."""
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, "train/loss")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return {m.step: m.value for m in history}


def assert_same_step_losses(tracking_uri: str, run_id: str, reference_id: str, steps: int):
    """Both runs logged steps 1..`steps`, each loss within 1e-5 of the reference's."""
    ours, reference = step_losses(tracking_uri, run_id), step_losses(tracking_uri, reference_id)
    assert sorted(ours) == sorted(reference) == list(range(1, steps + 1))
    gap = max(abs(ours[s] - reference[s]) for s in ours)
    assert gap < 1e-5, gap
