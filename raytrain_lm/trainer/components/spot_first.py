"""`scaling.capacity: spot_first`: spot nodes while the run keeps to `budget.deadline`, on-demand
nodes added while it is behind, given back once it is ahead again.

The rule is "Can't Be Late"'s uniform progress (Wu et al., NSDI'24): a run that has done the
fraction p of its steps, t seconds after its first start, with a deadline D, is on schedule
while p x D >= t. Its slack, p x D - t, is how far ahead of that line it is, in seconds.

- On spot (the workers carry the `spot` marker: placement.py), a negative slack asks the
  autoscaler for on-demand nodes for the workers the group lacks (up to scaling.max_workers)
  through Ray's autoscaling coordinator, as Ray Train asks for its own workers. The group
  keeps training on spot meanwhile; once on-demand nodes for them are up, the chief ends the
  group at a step boundary with a checkpoint and the driver starts the next one without the
  spot marker, on spot and on-demand nodes alike. A run that is ahead again (past the margin
  below) before the nodes came withdraws the request. A run back on spot after on-demand
  nodes asks again only once it is behind by more than the margin, until it is on schedule
  again: the switch back's own restart (longer than measured when the autoscaler took the
  idle nodes meanwhile) must not send it straight back, and later it asks as any run does.
- Off spot, the new group's own resource request holds the on-demand nodes, so the extra one
  is withdrawn (by the driver as soon as Ray Train's request is in: fit.py). A slack above the
  margin (twice the run's measured restart, at least 1 % of D: the switch back must leave the
  run ahead) ends the group again, and the next one carries the spot marker: nothing of the
  run fits on the on-demand nodes, which the autoscaler removes once idle.

Every request, withdrawal and decision is an event in the run's log (`capacity_request`,
`capacity_withdrawn`, `capacity_full`, `capacity_switch`) and a line. The switch itself is the
`capacity` event the driver writes once the group has ended for it: its `market` is where
the next groups go (`current_market`), also after a resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from raytrain_lm.costs.planner import DEFAULT_RECOVERY_S
from raytrain_lm.run_events.goodput import summarize

SPOT, ON_DEMAND = "spot", "on_demand"
# The chief's decision to switch (with the figures it decided on), and, written by the driver
# once the group has ended for it, the switch itself: `market` is where the next groups go.
SWITCH, CAPACITY = "capacity_switch", "capacity"
RENEW_EVERY_S = 20.0  # as Ray Train renews its own request (it expires after 180 s)
UP_CHECK_EVERY_S = 10.0  # how often a chief waiting for on-demand nodes looks for them
MIN_MARGIN_FRACTION = 0.01  # of the deadline


def current_market(events: list[dict[str, Any]]) -> str:
    """`spot`, or `on_demand` after a switch to on-demand nodes (then a group may use both)."""
    switches = [e for e in events if e["event"] == CAPACITY]
    return switches[-1]["market"] if switches else SPOT


def slack_s(step: int, end_step: int, elapsed_s: float, deadline_s: float) -> float:
    """Seconds ahead of the uniform-progress line (negative: behind it)."""
    return step / max(1, end_step) * deadline_s - elapsed_s


def margin_s(deadline_s: float, restart_s: float) -> float:
    """How far ahead a run on on-demand nodes must be to give them back: two restarts (the
    switch back costs one and must still leave it ahead, or it would switch again at once),
    and at least 1 % of the deadline."""
    return max(MIN_MARGIN_FRACTION * deadline_s, 2 * restart_s)


def returned_to_spot(events: list[dict[str, Any]]) -> bool:
    """Whether the run has given on-demand nodes back before."""
    return any(e["event"] == CAPACITY and e["market"] == SPOT for e in events)


def measured_restart_s(events: list[dict[str, Any]]) -> float:
    """The run's mean time from a group's end to the next one's first step, else the planner's
    default (a cloud node's replacement)."""
    goodput = summarize(events)
    return goodput.recovery_s / goodput.restarts if goodput.restarts else DEFAULT_RECOVERY_S


class CapacityRequests(Protocol):
    """The autoscaler's side (placement.py's functions on a real cluster)."""

    def request(self, count: int) -> None: ...
    def up(self) -> int: ...
    def withdraw(self) -> None: ...


@dataclass
class Note:
    """An event for the run's log and the line that says it."""

    event: str
    fields: dict[str, Any]
    line: str


@dataclass
class Decision:
    notes: list[Note] = field(default_factory=list)
    switch_to: str | None = None  # end this group: the next one goes to this market


class DeadlineCapacity:
    """The chief's side of spot_first, asked at its signal checks."""

    def __init__(
        self,
        *,
        market: str,
        deadline_s: float,
        first_start: float,
        end_step: int,
        max_workers: int,
        restart_s: float,
        requests: CapacityRequests,
        returned: bool = False,
    ):
        self.market, self.deadline_s, self.first_start = market, deadline_s, first_start
        self.end_step, self.max_workers = end_step, max_workers
        self.restart_s, self.margin_s = restart_s, margin_s(deadline_s, restart_s)
        self.requests = requests
        # Behind by more than this asks for on-demand nodes (a slack, so 0 or negative);
        # back from on-demand nodes, the margin until the run is on schedule again.
        self.ask_below_s = -self.margin_s if returned else 0.0
        self.asked: int = 0  # on-demand workers asked for (spot phase)
        self.renewed_at = self.looked_at = 0.0
        self.said_full = False
        self.switch_to: str | None = None  # the market of the switch decided, if any
        # An earlier group's request may still stand: off spot, this group's own (Ray
        # Train's) holds the on-demand nodes; on spot, it is withdrawn unless asked again.
        self.withdraw_pending = True

    def check(self, step: int, world: int, now: float | None = None) -> Decision:
        decision = self._check(step, world, time.time() if now is None else now)
        self.switch_to = decision.switch_to
        return decision

    def _check(self, step: int, world: int, now: float) -> Decision:
        slack = slack_s(step, self.end_step, now - self.first_start, self.deadline_s)
        figures = {
            "step": step,
            "slack_s": round(slack, 1),
            "world_size": world,
            "margin_s": round(self.margin_s, 1),
            "restart_s": round(self.restart_s, 1),
            "ask_below_s": round(self.ask_below_s, 1),
        }
        decision = Decision()
        if slack >= 0:
            self.ask_below_s = 0.0  # on schedule again: the switch back is behind it
        asks = slack < self.ask_below_s and self.max_workers > world
        if self.withdraw_pending and (self.market == ON_DEMAND or not asks):
            self.requests.withdraw()
        self.withdraw_pending = False
        if self.market == ON_DEMAND:
            if slack > self.margin_s:
                decision.switch_to = SPOT
                decision.notes.append(
                    Note(
                        SWITCH,
                        {**figures, "market": SPOT},
                        f"deadline: {slack:,.0f} s ahead of schedule at step {step} (margin "
                        f"{self.margin_s:,.0f} s): back to spot nodes only; the on-demand "
                        "nodes are given back",
                    )
                )
            return decision
        if self.asked and slack > self.margin_s:
            self.requests.withdraw()
            self.asked = 0
            decision.notes.append(
                Note(
                    "capacity_withdrawn",
                    figures,
                    f"deadline: {slack:,.0f} s ahead of schedule at step {step} (margin "
                    f"{self.margin_s:,.0f} s) before the on-demand nodes came: request withdrawn",
                )
            )
        elif slack < self.ask_below_s or self.asked:  # behind, or asked and not yet ahead
            self._ask(step, world, slack, now, figures, decision)
        return decision

    def _ask(
        self, step: int, world: int, slack: float, now: float, figures: dict, decision: Decision
    ) -> None:
        """Asks for (or renews) on-demand nodes for the workers the group lacks; once they
        are up, the group ends for the next to use them."""
        wanted = self.max_workers - world
        if wanted <= 0:
            if not self.said_full:
                self.said_full = True
                decision.notes.append(
                    Note(
                        "capacity_full",
                        figures,
                        f"deadline: {-slack:,.0f} s behind schedule at step {step} with "
                        f"scaling.max_workers={self.max_workers} workers already: on-demand "
                        "nodes cannot add any",
                    )
                )
            return
        if self.asked != wanted or now - self.renewed_at >= RENEW_EVERY_S:
            self.requests.request(wanted)
            self.renewed_at = now
            if self.asked != wanted:
                decision.notes.append(
                    Note(
                        "capacity_request",
                        {**figures, "workers": wanted},
                        f"deadline: {-slack:,.0f} s behind schedule at step {step}: asking for "
                        f"on-demand nodes for {wanted} more worker(s)",
                    )
                )
            self.asked = wanted
        if now - self.looked_at < UP_CHECK_EVERY_S:
            return
        self.looked_at = now
        if self.requests.up() >= wanted:
            decision.switch_to = ON_DEMAND
            decision.notes.append(
                Note(
                    SWITCH,
                    {**figures, "market": ON_DEMAND, "workers": wanted},
                    f"deadline: on-demand nodes for {wanted} worker(s) are up at step {step} "
                    f"({-slack:,.0f} s behind schedule): the group restarts on spot and "
                    "on-demand nodes",
                )
            )
