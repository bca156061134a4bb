"""The arithmetic of exactly-once with replica groups (trainer/groups/replicas.py), without Ray:
whoever takes part in a step, its positions are taken once; and what replicas refuses."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_lm.config import TrainingConfig, load_config
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.components.batch_plan import BatchPlan
from raytrain_lm.trainer.groups.roster import check_step_taken, position_checksum

pytestmark = pytest.mark.no_ray

GLOBAL_BATCH = 12


@pytest.mark.parametrize("participants", [1, 2, 3, 4, 5])
def test_any_number_of_participants_takes_each_position_once(participants):
    """However many groups take part, their slices of step s are [s*G, (s+1)*G) exactly, and
    the loss weights P*b/G averaged over the P participants sum to one; a participant that
    sliced with another count than the others is caught by the checksum."""
    training = TrainingConfig(global_batch_size=GLOBAL_BATCH)
    plan = BatchPlan.derive(training, participants, [1.0] * participants)
    step = 7
    positions = np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    slices = [
        positions[plan.offset(p) : plan.offset(p) + plan.shares[p]] for p in range(participants)
    ]
    assert np.array_equal(np.concatenate(slices), positions)
    weights = [participants * len(s) / GLOBAL_BATCH for s in slices]
    assert sum(weights) / participants == pytest.approx(1.0)
    summed = np.sum([position_checksum(s) for s in slices], axis=0).tolist()
    check_step_taken(step, GLOBAL_BATCH, summed)
    if participants > 1:  # one participant still believes in one more
        stale = BatchPlan.derive(training, participants + 1, [1.0] * (participants + 1))
        last = participants - 1  # its slice by the stale plan
        wrong = [
            *slices[:-1],
            positions[stale.offset(last) : stale.offset(last) + stale.shares[last]],
        ]
        with pytest.raises(RuntimeError, match="took positions"):
            check_step_taken(
                step, GLOBAL_BATCH, np.sum([position_checksum(s) for s in wrong], axis=0).tolist()
            )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "use parallel.strategy=ddp"),
        (["parallel.sync=diloco", "scaling.balance=auto"], "set for a whole round"),
        (["scaling.num_workers=4", "training.global_batch_size=3"], "fewer than one sequence"),
    ],
)
def test_replicas_refuses_what_it_cannot_do(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["scaling.fault_tolerance=replicas", *overrides])


def test_goodput_counts_each_replica_incident_once():
    """Every group records the change it saw; goodput counts one incident per step, with the
    survivors' longest gap, and the time until as many groups took part again."""
    from raytrain_lm.run_events.goodput import summarize

    def change(t, step, group, now, before, gap):
        return {"event": "replicas_changed", "t": t, "step": step, "group": group,
                "participants": now, "previous": before, "gap_s": gap}  # fmt: skip

    events = [
        change(10.0, 16, 0, 1, 2, 2.1),  # group 1 lost: one incident, seen by the survivor
        change(30.0, 110, 0, 2, 1, 2.5),  # its replacement back: full strength after 20 s
        change(30.1, 110, 1, 2, 1, 2.4),
        change(31.0, 111, 0, 1, 2, 2.0),  # drained: open until `now`
    ]
    g = summarize(events, now=41.0)
    assert g.replica_incidents == 2
    assert g.replica_stall_s == pytest.approx(4.1)
    assert g.full_strength_s == pytest.approx(20.0 + 10.0)
    assert g.metrics(tokens=0)["goodput/replica_incidents"] == 2


@pytest.mark.parametrize(
    "kinds", [["A100"], ["cpu", "H100"], ["L4", "AMD-Instinct-MI300X-OAM", "T4"]]
)
def test_the_participants_types_and_prices_ride_in_the_steps_sum(kinds):
    """Each participant writes its accelerator type and price into its own slots of the
    step's summed values: whoever is chief reads every participant's type, in participating
    rank order, and what they cost together."""
    from raytrain_lm.trainer.components.balance import per_type_metrics
    from raytrain_lm.trainer.groups.roster import read_roster, roster_slots

    prices = [1.5 * (p + 1) for p in range(len(kinds))]
    slots = [roster_slots(p, len(kinds), kind, prices[p]) for p, kind in enumerate(kinds)]
    types, read_prices = read_roster(np.sum(slots, axis=0).tolist())
    assert types == kinds and read_prices == pytest.approx(prices)
    peaks = [1e12] * len(kinds)
    figures = per_type_metrics(types, [4] * len(kinds), 1000.0, 1e6, read_prices, peaks)
    assert set(figures) == set(kinds)
    assert sum(f["tokens_per_s"] for f in figures.values()) == pytest.approx(1000.0)
    usd_per_hour = sum(f["usd_per_mtok"] * f["tokens_per_s"] / 1e6 * 3600 for f in figures.values())
    assert usd_per_hour == pytest.approx(sum(prices))


def test_goodput_prices_a_replica_segment_by_the_groups_taking_part():
    """A replica segment costs what its participating groups cost, as they change: the
    chief's first `replica_price` from the segment's start, each later one from its time."""
    from raytrain_lm.run_events.goodput import summarize

    def price(t, usd):
        return {"event": "replica_price", "t": t, "segment": "s", "price_per_hour": usd}

    start = {"event": "segment_start", "t": 0.0, "segment": "s", "t_start": 0.0,
             "t_restored": 1.0, "restored_step": 0, "price_per_hour": 1.0}  # fmt: skip
    end = {"event": "segment_end", "t": 3600.0, "segment": "s", "step": 100, "step_seconds": 1.0}
    # Two groups at $2/h each from the start; one lost at 1800 s; back at 2700 s.
    events = [start, price(5.0, 4.0), price(1800.0, 2.0), price(2700.0, 4.0), end]
    g = summarize(events)
    assert g.cost == pytest.approx(4.0 * 0.5 + 2.0 * 0.25 + 4.0 * 0.25)
    assert summarize([start, end]).cost == pytest.approx(1.0)  # restart mode: as before


def test_the_chiefs_checkpoint_interval_rides_in_a_step_and_every_participant_takes_it(tmp_path):
    """checkpoint.every_steps=auto: the chief's choice after its checkpoint at step 30 goes in
    the next step's sums; every participant (and the chief) puts it in use as that step
    commits, counted from step 30, and the chief stops sending it. Two proposals in one sum
    (two groups each thinking itself chief) are not taken."""
    from raytrain_lm.trainer.components.cadence import Every
    from raytrain_lm.trainer.groups.interval import IntervalAgreement

    chief, other = IntervalAgreement(tmp_path), IntervalAgreement(tmp_path)
    cadences = [Every(steps=10, at_end=True), Every(steps=10, at_end=True)]
    chief.propose(25, 30)
    summed = np.sum([chief.sums(), other.sums()], axis=0).tolist()
    for agreement, cadence in zip((chief, other), cadences, strict=True):
        agreement.settle(summed, cadence)
    assert [(c.steps, c.since) for c in cadences] == [(25, 30), (25, 30)]
    assert [c.due(55, 100) for c in cadences] == [True, True]
    assert chief.sums() == [0.0, 0.0, 0.0]  # taken: not sent again
    chief.propose(40, 55)
    other.propose(50, 55)
    both = np.sum([chief.sums(), other.sums()], axis=0).tolist()
    chief.settle(both, cadences[0])
    assert (cadences[0].steps, cadences[0].since) == (25, 30)


def test_a_chiefs_running_spend_starts_from_the_events(tmp_path):
    """budget.max_usd with replica groups: a chief's account is the events' price of the run
    when it became chief (read on a thread of its own: never inside a step), then the groups'
    price at each of its steps."""
    from raytrain_lm.run_events.journal import append_event
    from raytrain_lm.rundir import RunDir
    from raytrain_lm.trainer.components.budget import RunningSpend

    run_dir = RunDir.coerce(tmp_path)
    append_event(run_dir, "segment_start", segment="s", t_start=1000.0, t_restored=1000.0,
                 restored_step=0, world_size=1, price_per_hour=3600.0, t=1000.0)  # fmt: skip
    spend = RunningSpend(run_dir, now=1010.0)
    assert spend.read.result()[0] == pytest.approx(10.0)  # 10 s at $3,600/h, on its thread
    assert spend.add(1015.0, 7200.0) == pytest.approx(20.0)  # and 5 s at $7,200/h


class FakeClock:
    """A ForwardClock's measurements, given: (seconds, sequences) per take."""

    def __init__(self):
        self.pending = (0.0, 0)
        self.taken: list[tuple[float, int]] = []

    def forward(self, seconds: float, sequences: int) -> None:
        self.pending = (self.pending[0] + seconds, self.pending[1] + sequences)

    def take(self) -> tuple[float, int]:
        measured, self.pending = self.pending, (0.0, 0)
        self.taken.append(measured)
        return measured


def test_a_group_declares_its_measured_speed_and_shares_follow_the_declarations():
    """Each group times its forwards after a warm-up and declares its sequences/s once it has
    measured MEASURE_STEPS steps, and again only past the tolerance; the participants' sum of
    declarations gives every participant the same weights, an undeclared group the mean of
    the declared, and nobody declared equal ones; a share that changes is measured anew."""
    from raytrain_lm.trainer.components.balance import MEASURE_STEPS
    from raytrain_lm.trainer.components.pending_values import WARMUP_STEPS
    from raytrain_lm.trainer.groups.speeds import DeclaredSpeed, agreed_weights

    clock = FakeClock()
    speed = DeclaredSpeed(clock, tolerance=0.15)

    def step(s: int, share: int, seconds_per_sequence: float) -> None:
        speed.before_step(s)
        speed.agreed_share(s, share)
        clock.forward(seconds_per_sequence * share, share)

    for s in range(WARMUP_STEPS + MEASURE_STEPS):
        step(s, 6, 0.5 if s < WARMUP_STEPS else 0.05)  # the warm-up compiles: slow
        assert speed.declared is None, s
    step(WARMUP_STEPS + MEASURE_STEPS, 6, 0.05)
    assert speed.declared == pytest.approx(20.0)  # the warm-up's passes left out
    assert speed.slots(1, 2, group=1) == pytest.approx([0, 20, 0, 1, 0, 2])  # place 1: group 1
    first = WARMUP_STEPS + MEASURE_STEPS + 1
    for s in range(first, first + MEASURE_STEPS):  # within the tolerance: no new declaration
        step(s, 6, 0.055)
    assert speed.declared == pytest.approx(20.0)
    changed_at = first + MEASURE_STEPS
    step(changed_at, 8, 0.1)  # a new share: measured anew after its own warm-up
    for s in range(changed_at + 1, changed_at + WARMUP_STEPS + MEASURE_STEPS):
        step(s, 8, 0.1)
    assert speed.declared == pytest.approx(20.0)
    step(changed_at + WARMUP_STEPS + MEASURE_STEPS, 8, 0.1)
    assert speed.declared == pytest.approx(10.0)  # half speed: past the tolerance

    summed = np.sum([[30.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 10.0, 0.0, 0.0, 1.0, 0.0]], axis=0)
    assert agreed_weights(summed.tolist(), 3) == [30.0, 10.0, 20.0]  # the third: the mean
    assert agreed_weights([0.0] * 4, 2) == [1.0, 1.0]  # nobody measured yet
    assert agreed_weights([30.0, 10.0, 1.0, 2.0], 2) is None  # not a sum of declarations
    training = TrainingConfig(global_batch_size=GLOBAL_BATCH)
    assert BatchPlan.derive(training, 2, [30.0, 10.0]).shares == (9, 3)


def test_the_stop_flag_carries_the_chiefs_reason_to_whoever_writes_the_stop(tmp_path):
    """The chief sends its reason's code in the stop flag; any group that sees the summed flag
    knows why, so a chief that took over before the stop was written says why (a budget
    spent), not the default (a request). A group that is not chief sends nothing."""
    from types import SimpleNamespace

    from raytrain_lm.rundir import RunDir
    from raytrain_lm.trainer.components import stop_requests
    from raytrain_lm.trainer.groups.chief_stops import ChiefStops

    run_dir = RunDir.coerce(tmp_path)
    from raytrain_lm.trainer.components.cadence import Every

    cfg = load_config(None, ["scaling.fault_tolerance=replicas"])
    progress = SimpleNamespace(step=5)
    chief = SimpleNamespace(is_chief=True, parts=SimpleNamespace(progress=progress, end_step=10),
                            price_per_hour=lambda: 1.0)  # fmt: skip
    stops, successor = ChiefStops(cfg, run_dir, "cpu", 1.0), ChiefStops(cfg, run_dir, "cpu", 1.0)
    stops.checks = Every(steps=1)  # checked at every step, not on the clock
    assert stops.flag(chief) == 0.0 and not successor.seen(0.0)
    stops.reason = "budget"  # as `due` sets it when the spend reached budget.max_usd
    stop_requests.request_stop(run_dir, "budget")
    flag = stops.flag(SimpleNamespace(**{**vars(chief), "is_chief": False}))
    assert flag == 0.0  # only the chief speaks
    flag = stops.flag(chief)
    assert flag == 1.0 and stops.reason == "request"  # a request found first: its own code
    stops.reason = "budget"
    assert successor.seen(2.0) and successor.reason == "budget"
    assert successor.seen(flag) and successor.reason == "request"


def test_a_speed_plan_counts_once_its_step_commits_and_is_recorded_when_declarations_moved_it():
    """Before each step the participants sum their declarations (a fake quorum returns the
    sums here): equal shares until both groups declared, then shares by speed, recorded once
    by the chief (`batch_plan`, the groups and their speeds) as that step commits. A failed
    reduction's vector (a group's own) is never settled; equal declared speeds and a change
    of members record nothing."""
    from types import SimpleNamespace

    import torch

    from raytrain_lm.trainer.groups.replica_step import ReplicaStep

    cfg = load_config(
        None,
        [
            "scaling.fault_tolerance=replicas",
            "scaling.balance=auto",
            "training.global_batch_size=12",
        ],
    )
    events, logged, sums = [], [], []
    parts = SimpleNamespace(
        cfg=cfg, progress=SimpleNamespace(step=0), device=torch.device("cpu"),
        trainee=SimpleNamespace(clock=FakeClock()),
        tracker=SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics))),
        journal=SimpleNamespace(event=lambda name, **fields: events.append((name, fields))),
    )  # fmt: skip
    quorum = SimpleNamespace(sum=lambda vector: torch.tensor(sums.pop(0), dtype=torch.float64))
    members = SimpleNamespace(participant=0, participants=2)
    group = SimpleNamespace(group=0, members=members, quorum=quorum, is_chief=True)
    replica_step = ReplicaStep(group, parts)

    def take(step: int, summed: list[float], commits: bool = True) -> tuple[int, ...]:
        parts.progress.step = step
        sums.append(summed)
        replica_step.plan = replica_step.shares_plan()
        if commits:
            replica_step._settle_speeds()
        return replica_step.plan.shares

    assert take(0, [0, 0, 0, 0, 1, 2]) == (6, 6)  # nobody has measured
    assert take(1, [20, 0, 1, 0, 1, 2]) == (6, 6)  # group 1 counts at group 0's speed
    assert take(2, [20, 10, 1, 1, 1, 2], commits=False) == (8, 4)  # the vote fails
    assert take(2, [20, 0, 1, 0, 1, 0], commits=False) == (6, 6)  # a failed sum: its own
    assert not events and replica_step.speed.share == 6
    assert take(2, [20, 10, 1, 1, 1, 2]) == (8, 4)  # taken again: commits
    ((name, fields),) = events
    assert name == "batch_plan" and fields["step"] == 2 and fields["groups"] == [0, 1]
    assert fields["shares"] == [8, 4] and fields["sequences_per_s"] == [20, 10]
    assert logged == [(2, {"plan/rank0_share": 8.0, "plan/rank1_share": 4.0})]
    assert replica_step.speed.share == 8  # this group measures its new share anew
    assert take(3, [20, 10, 1, 1, 1, 2]) == (8, 4)
    members.participants = 3  # a third group joins: the members' change, not a new plan
    assert take(4, [20, 10, 0, 1, 1, 0, 1, 2, 3]) == (5, 3, 4)  # the third: the mean
    assert take(5, [20, 20, 20, 1, 1, 1, 1, 2, 3]) == (4, 4, 4)  # declarations moved it
    assert len(events) == 2 and events[1][1]["groups"] == [0, 1, 2]


def test_whichever_group_is_chief_logs_the_runs_spend_and_projections(tmp_path):
    """With budget.* set, a replica group's cost metrics come from the account its chief keeps
    (budget.RunningSpend), so a chief that took over logs `cost/spent`, `cost/projected` and
    the deadline's slack from the run's events, not from its own journal; a group that is not
    chief logs none (the chief's are the run's)."""
    from types import SimpleNamespace

    from raytrain_lm.run_events.journal import append_event
    from raytrain_lm.rundir import RunDir
    from raytrain_lm.trainer.components.cadence import Every
    from raytrain_lm.trainer.groups.chief_stops import ChiefStops

    run_dir = RunDir.coerce(tmp_path)
    append_event(run_dir, "job_start", t=900.0)
    append_event(run_dir, "segment_start", segment="s", t_start=1000.0, t_restored=1000.0,
                 restored_step=0, world_size=2, price_per_hour=7200.0, t=1000.0)  # fmt: skip
    overrides = ["scaling.fault_tolerance=replicas", "fault.price_per_hour.cpu=3600",
                 "budget.max_usd=1000", "budget.deadline=1h", "training.max_steps=100"]  # fmt: skip
    successor = ChiefStops(load_config(None, overrides), run_dir, "cpu", 3600.0)
    successor.checks = Every(steps=1000)
    progress = SimpleNamespace(step=40)
    chief = SimpleNamespace(is_chief=True, parts=SimpleNamespace(progress=progress, end_step=100),
                            price_per_hour=lambda: 7200.0)  # fmt: skip
    assert successor.metrics([], 1010.0, 40, 1.0, 7200.0) == {}  # nothing read yet
    assert not successor.due(chief, now=1010.0)  # takes over: reads the events on its thread
    successor.spend.read.result()  # read
    assert not successor.due(chief, now=1010.0)  # under budget
    metrics = successor.metrics([], 1010.0, 40, 1.0, 7200.0)
    assert metrics["cost/spent"] == pytest.approx(20.0)  # 10 s at $7,200/h
    assert metrics["cost/projected"] == pytest.approx(20.0 + 60 * 2.0)  # 60 steps of 1 s
    assert metrics["time/projected_finish_h"] == pytest.approx((1010 + 60 - 900) / 3600)
    assert metrics["time/slack_s"] == pytest.approx(0.4 * 3600 - 110)
    successor.due(SimpleNamespace(**{**vars(chief), "is_chief": False}), now=1011.0)
    assert successor.metrics([], 1011.0, 41, 1.0, 7200.0) == {}
