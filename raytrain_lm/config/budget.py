"""What a run may spend and by when it should be done (trainer/components/budget.py, docs/cost.md)."""

from __future__ import annotations

from pydantic import Field, field_validator

from raytrain_lm.config.base import _Section


class BudgetConfig(_Section):
    max_usd: float | None = Field(
        None,
        gt=0.0,
        description="at this spend (fault.price_per_hour x workers x time, every restart "
        "included) the run checkpoints and ends, resumable with a larger budget",
    )
    deadline: str | float | None = Field(
        None,
        description="e.g. 36h, 2d or hours: from the run's first start; a projection past it "
        "is said",
    )

    @field_validator("deadline")
    @classmethod
    def _a_duration(cls, value: str | float | None) -> str | float | None:
        if value is not None:
            from raytrain_lm.config.durations import parse_duration_h

            if parse_duration_h(value) <= 0:
                raise ValueError("a deadline is a positive duration")
        return value

    @property
    def deadline_s(self) -> float | None:
        from raytrain_lm.config.durations import parse_duration_h

        return None if self.deadline is None else 3600 * parse_duration_h(self.deadline)
