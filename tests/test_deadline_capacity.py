"""scaling.capacity=spot_first (trainer/components/spot_first.py): the uniform-progress rule, when it asks
for on-demand nodes, when it moves the group onto them and back, and the placement of each
phase. The run on the local autoscaling cluster is in test_jobs.py."""

from __future__ import annotations

import pytest

from raytrain_lm.config import load_config
from raytrain_lm.devices import price_per_hour
from raytrain_lm.errors import UserError
from raytrain_lm.placement import MARKER_AMOUNT, labels_match, worker_resources
from raytrain_lm.trainer.components.spot_first import (
    CAPACITY,
    ON_DEMAND,
    SPOT,
    SWITCH,
    UP_CHECK_EVERY_S,
    DeadlineCapacity,
    current_market,
    margin_s,
    returned_to_spot,
    slack_s,
)

DEADLINE_S = 1000.0


class Autoscaler:
    """The autoscaler's side as the rule sees it: what was asked, what is up."""

    def __init__(self):
        self.asked: list[int] = []
        self.withdrawn = 0
        self.nodes_up = 0

    def request(self, count: int) -> None:
        self.asked.append(count)

    def up(self) -> int:
        return self.nodes_up

    def withdraw(self) -> None:
        self.withdrawn += 1


def _rule(
    market: str = SPOT, max_workers: int = 3, restart_s: float = 30.0, returned: bool = False
):
    autoscaler = Autoscaler()
    rule = DeadlineCapacity(
        market=market,
        deadline_s=DEADLINE_S,
        first_start=0.0,
        end_step=1000,
        max_workers=max_workers,
        restart_s=restart_s,
        requests=autoscaler,
        returned=returned,
    )
    return rule, autoscaler


def test_slack_is_the_distance_to_the_uniform_progress_line():
    assert slack_s(500, 1000, 400.0, DEADLINE_S) == 100.0  # half done at 40 %: 100 s ahead
    assert slack_s(100, 1000, 400.0, DEADLINE_S) == -300.0
    assert slack_s(1000, 1000, DEADLINE_S, DEADLINE_S) == 0.0
    assert margin_s(DEADLINE_S, 30.0) == 60.0  # two restarts
    assert margin_s(DEADLINE_S, 1.0) == 10.0  # at least 1 % of the deadline
    assert margin_s(DEADLINE_S, 400.0) == 800.0  # never less than the switch back costs


def test_behind_on_spot_asks_for_the_missing_workers_then_switches_once_they_are_up():
    rule, autoscaler = _rule()
    on_time = rule.check(step=500, world=2, now=400.0)
    assert on_time.switch_to is None and not on_time.notes and not autoscaler.asked

    assert autoscaler.withdrawn == 1  # an earlier group's request, if any
    behind = rule.check(step=100, world=2, now=400.0)
    assert autoscaler.asked == [1] and behind.switch_to is None
    (note,) = behind.notes
    assert note.event == "capacity_request" and note.fields["workers"] == 1
    assert note.fields["slack_s"] == -300.0 and "300 s behind schedule at step 100" in note.line

    assert not rule.check(step=101, world=2, now=405.0).notes  # asked already: quiet
    assert autoscaler.asked == [1]
    rule.check(step=110, world=2, now=421.0)  # renewed before Ray's request expires
    assert autoscaler.asked == [1, 1]

    autoscaler.nodes_up = 1  # it looked at 421 s: the next look comes UP_CHECK_EVERY_S later
    assert rule.check(step=115, world=2, now=421.0 + UP_CHECK_EVERY_S / 2).switch_to is None
    switch = rule.check(step=120, world=2, now=421.0 + UP_CHECK_EVERY_S)
    assert switch.switch_to == ON_DEMAND == rule.switch_to
    (note,) = switch.notes
    assert note.event == SWITCH and note.fields["market"] == ON_DEMAND
    assert note.fields["margin_s"] == 60.0 and note.fields["restart_s"] == 30.0
    assert "the group restarts on spot and on-demand nodes" in note.line


def test_a_run_back_on_schedule_before_the_nodes_came_withdraws_its_request():
    rule, autoscaler = _rule()
    rule.check(step=100, world=1, now=400.0)
    assert autoscaler.asked == [2]
    within_margin = rule.check(step=450, world=1, now=420.0)  # 30 s ahead, margin 60 s
    assert within_margin.switch_to is None and not autoscaler.withdrawn
    ahead = rule.check(step=500, world=1, now=430.0)  # 70 s ahead
    assert autoscaler.withdrawn == 1 and ahead.switch_to is None
    assert [n.event for n in ahead.notes] == ["capacity_withdrawn"]
    assert not rule.check(step=510, world=1, now=440.0).notes


def test_at_max_workers_on_demand_nodes_cannot_help_and_it_says_so_once():
    rule, autoscaler = _rule(max_workers=2)
    first = rule.check(step=100, world=2, now=400.0)
    assert [n.event for n in first.notes] == ["capacity_full"] and first.switch_to is None
    assert "scaling.max_workers=2" in first.notes[0].line
    assert not rule.check(step=101, world=2, now=410.0).notes and not autoscaler.asked


def test_on_demand_phase_withdraws_the_extra_request_and_returns_to_spot_past_the_margin():
    rule, autoscaler = _rule(market=ON_DEMAND)
    behind = rule.check(step=100, world=3, now=400.0)
    assert autoscaler.withdrawn == 1  # the group's own request holds the nodes now
    assert behind.switch_to is None and not behind.notes
    assert rule.check(step=450, world=3, now=400.0).switch_to is None  # 50 s < margin 60 s
    back = rule.check(step=470, world=3, now=400.0)
    assert back.switch_to == SPOT
    (note,) = back.notes
    assert note.event == SWITCH and note.fields["market"] == SPOT
    assert "the on-demand nodes are given back" in note.line
    assert autoscaler.withdrawn == 1 and not autoscaler.asked


def test_back_on_spot_it_asks_again_only_once_behind_by_more_than_the_margin():
    """The switch back's restart can outlast the measured one (the autoscaler removes the idle
    nodes meanwhile): a run just behind the line after it would otherwise flap straight back."""
    rule, autoscaler = _rule(returned=True)
    just_behind = rule.check(step=100, world=2, now=150.0)  # 50 s behind, margin 60 s
    assert just_behind.switch_to is None and not just_behind.notes and not autoscaler.asked
    behind = rule.check(step=100, world=2, now=161.0)  # 61 s behind
    (note,) = behind.notes
    assert note.event == "capacity_request" and autoscaler.asked == [1]
    assert note.fields["ask_below_s"] == -60.0 and note.fields["slack_s"] == -61.0


def test_back_on_schedule_after_the_return_it_asks_as_any_run_does():
    """The margin covers the switch back only: a run that caught up again and then fell
    behind (near the deadline, a margin late would be too late) asks at once."""
    rule, autoscaler = _rule(returned=True)
    assert not rule.check(step=100, world=2, now=150.0).notes  # 50 s behind: the switch back
    assert not rule.check(step=200, world=2, now=190.0).notes  # 10 s ahead: on schedule
    (note,) = rule.check(step=210, world=2, now=215.0).notes  # 5 s behind
    assert note.event == "capacity_request" and note.fields["ask_below_s"] == 0.0


def test_the_newest_switch_says_where_a_group_goes():
    assert current_market([]) == SPOT
    events = [
        {"event": "capacity_request", "workers": 1},
        {"event": CAPACITY, "market": ON_DEMAND},
        {"event": "segment_start"},
    ]
    assert current_market(events) == ON_DEMAND and not returned_to_spot(events)
    back = [*events, {"event": CAPACITY, "market": SPOT}]
    assert current_market(back) == SPOT and returned_to_spot(back)


def test_spot_first_places_workers_on_spot_then_on_either():
    scaling = load_config(
        None,
        [
            "scaling.capacity=spot_first",
            "budget.deadline=2h",
            "scaling.use_gpu=false",
            "scaling.min_workers=1",
            "scaling.max_workers=2",
        ],
    ).scaling
    cluster = {"cpu_node": 2.0}
    on_spot = worker_resources(scaling, False, cluster, SPOT)["resources_per_worker"]
    assert on_spot["spot"] == MARKER_AMOUNT and "on_demand" not in on_spot
    either = worker_resources(scaling, False, cluster, ON_DEMAND)["resources_per_worker"]
    assert "spot" not in either and "on_demand" not in either
    assert on_spot["cpu_node"] == either["cpu_node"] == MARKER_AMOUNT


def test_a_new_spot_group_on_schedule_withdraws_what_an_earlier_one_asked():
    rule, autoscaler = _rule()
    assert not rule.check(step=500, world=2, now=400.0).notes
    assert autoscaler.withdrawn == 1 and not autoscaler.asked
    rule.check(step=500, world=2, now=401.0)
    assert autoscaler.withdrawn == 1  # once


def test_on_demand_nodes_must_carry_the_selected_labels():
    assert labels_match({"ray.io/accelerator-type": "A100"}, {})
    selector = {"ray.io/accelerator-type": "in(A100,H100)"}
    assert labels_match({"ray.io/accelerator-type": "H100"}, selector)
    assert not labels_match({"ray.io/accelerator-type": "L4"}, selector)
    assert not labels_match({}, selector)
    assert labels_match({"zone": "b"}, {"zone": "!a"})
    assert not labels_match({"zone": "a"}, {"zone": "!in(a,c)"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["scaling.capacity=spot_first", "scaling.min_workers=1", "scaling.max_workers=2"],
            "spot_first keeps to budget.deadline: set it",
        ),
        (
            ["scaling.capacity=spot_first", "budget.deadline=2h", "scaling.num_workers=2"],
            "set scaling.min_workers below scaling.max_workers",
        ),
        (
            [
                "scaling.capacity=spot_first",
                "budget.deadline=2h",
                "scaling.fault_tolerance=replicas",
                "scaling.min_workers=1",
                "scaling.max_workers=2",
            ],
            "replica groups cannot yet",
        ),
    ],
)
def test_spot_first_refuses_what_it_cannot_keep(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_prices_tell_spot_from_on_demand_nodes():
    table = {"A100": 3.0, "A100:spot": 1.2, "cpu:on_demand": 0.2, "default": 0.1}
    assert price_per_hour(table, "A100", "spot") == 1.2
    assert price_per_hour(table, "A100-80G", "spot") == 1.2
    assert price_per_hour(table, "A100", "on_demand") == 3.0  # the type's own entry
    assert price_per_hour(table, "A100") == 3.0
    assert price_per_hour(table, "cpu", "on_demand") == 0.2
    assert price_per_hour(table, "cpu", "spot") == price_per_hour(table, "cpu") == 0.1
