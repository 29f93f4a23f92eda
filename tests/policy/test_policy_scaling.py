"""Anti-thrashing backs off reversals, not growth; arrivals that come together are admitted together."""

from __future__ import annotations

import pytest

from hyperpodrun.policy import Action, ClusterView, ElasticPolicy, NodeState, ScaleEvent, decide, required_stable_period

DEFAULT = ElasticPolicy(min_replicas=1, max_replicas=8)  # scaling_timeout 60, stable period 60 doubling to 600


def _view(members: tuple[str, ...], standbys: dict[str, float], events: list[ScaleEvent], **kwargs) -> ClusterView:
    alive = {m: NodeState(m, 0.0) for m in members} | {n: NodeState(n, t) for n, t in standbys.items()}
    return ClusterView(
        round=len(events), members=members, alive=alive, lost_since={}, last_events=tuple(events), **kwargs
    )


# --------------------------------------------------------------------------- growth streaks


def test_growing_one_node_at_a_time_takes_the_base_period_each_time() -> None:
    """SageMaker HyperPod's headline case: capacity frees up one node at a time, 1 -> 8."""
    members, events = ("n0",), [ScaleEvent(0.0, 1)]
    for k in range(1, 8):
        arrival = events[-1].at + 1.0  # the next node frees up just after the previous scale event
        view = _view(members, {f"n{k}": arrival}, events, capacity_since=arrival)
        assert required_stable_period(DEFAULT, view.last_events, arrival) == DEFAULT.min_stable_period
        waiting = decide(DEFAULT, view, arrival)
        assert (waiting.action, waiting.recheck_at) == (Action.NONE, arrival + DEFAULT.scaling_timeout)
        up = decide(DEFAULT, view, waiting.recheck_at)
        assert (up.action, up.members) == (Action.SCALE_UP, (*members, f"n{k}"))
        members = up.members
        events.append(ScaleEvent(waiting.recheck_at, len(members)))
    # 7 x (1 + 60) s = 427 s, about 7 minutes; doubling the period at every event took 45 minutes.
    assert [e.replicas for e in events] == list(range(1, 9))
    assert events[-1].at == 427.0


def test_growth_while_held_back_by_the_period_is_not_a_reversal() -> None:
    """Growth right after growth waits the base period since the last event, no more."""
    events = [ScaleEvent(0.0, 1), ScaleEvent(100.0, 2)]
    view = _view(("a", "b"), {"c": 0.0}, events)
    held = decide(DEFAULT, view, 159.0)
    assert (held.action, held.recheck_at) == (Action.NONE, 160.0)
    assert decide(DEFAULT, view, 160.0).action is Action.SCALE_UP


# --------------------------------------------------------------------------- reversals


def test_flapping_grows_the_period_with_every_reversal() -> None:
    """A node that comes and goes: up, down, up, down, up; each reversal doubles the period."""
    sizes = [2, 3, 2, 3, 2, 3]
    periods = []
    for n in range(1, len(sizes) + 1):
        events = tuple(ScaleEvent(100.0 * i, sizes[i]) for i in range(n))
        periods.append(required_stable_period(DEFAULT, events, events[-1].at))
    assert periods == [60.0, 60.0, 120.0, 240.0, 480.0, 600.0]  # capped at max_backoff


def test_scale_up_after_up_and_down_is_held_back_for_the_doubled_period() -> None:
    events = [ScaleEvent(0.0, 2), ScaleEvent(100.0, 3), ScaleEvent(200.0, 2)]  # the third node came and left
    view = _view(("a", "b"), {"c": 150.0}, events)
    held = decide(DEFAULT, view, 260.0)
    assert (held.action, held.recheck_at) == (Action.NONE, 320.0)
    assert "held back" in held.reason and "stable period 120s" in held.reason
    assert decide(DEFAULT, view, 320.0).members == ("a", "b", "c")


@pytest.mark.parametrize(
    ("sizes", "period"),
    [
        ((4, 3, 2), 60.0),  # shrinking step after step: base
        ((1, 2, 3, 2), 120.0),  # one reversal
        ((2, 3, 3, 2), 120.0),  # a same-size restart in between changes nothing
        ((2, 3, 2, 2, 3), 240.0),
    ],
)
def test_only_changes_of_direction_count(sizes: tuple[int, ...], period: float) -> None:
    events = tuple(ScaleEvent(10.0 * i, n) for i, n in enumerate(sizes))
    assert required_stable_period(DEFAULT, events, events[-1].at) == period


def test_a_quiet_backoff_window_forgets_old_reversals() -> None:
    events = (ScaleEvent(0.0, 2), ScaleEvent(10.0, 3), ScaleEvent(20.0, 2), ScaleEvent(1000.0, 3))
    assert required_stable_period(DEFAULT, events, 1000.0) == 60.0  # 980 s apart: a new streak
    assert required_stable_period(DEFAULT, events[:3], 20.0 + 900.0) == 120.0
    assert required_stable_period(DEFAULT, events[:3], 20.0 + 900.5) == 60.0


# --------------------------------------------------------------------------- arrivals together

# Three nodes freed at once, seen by the decider a tick apart.
_TOGETHER = {"s": 100.0, "t": 100.2, "u": 100.4}


@pytest.mark.parametrize(
    ("policy", "kwargs", "expected"),
    [
        (DEFAULT, {}, ("a", "s", "t", "u")),
        (ElasticPolicy(min_replicas=1, max_replicas=3), {}, ("a", "s", "t")),
        (DEFAULT, dict(cap=2), ("a", "s")),
        (ElasticPolicy(min_replicas=1, max_replicas=8, replica_increment_step=2), {}, ("a", "s", "t")),  # 1, 3, 5 ...
        (ElasticPolicy(min_replicas=1, max_replicas=8, replica_discrete_values=(1, 2, 4)), {}, ("a", "s", "t", "u")),
        (ElasticPolicy(min_replicas=1, max_replicas=8, replica_discrete_values=(1, 3, 8)), {}, ("a", "s", "t")),
        (DEFAULT, dict(nproc_per_node=2, max_world_size=6), ("a", "s", "t")),
    ],
)
def test_three_simultaneous_arrivals_become_one_scale_event(policy, kwargs, expected) -> None:
    cap = kwargs.pop("cap", None)
    view = _view(("a",), _TOGETHER, [ScaleEvent(0.0, 1)], cap=cap, capacity_since=100.0)
    early = decide(policy, view, 159.9, **kwargs)
    assert early.action is Action.NONE
    # Due once the smallest larger allowed size has waited scaling_timeout (160, or 160.2 when it
    # takes two nodes), before the last arrival's own 160.4: it is admitted without its own wait.
    assert early.recheck_at in (160.0, 160.2)
    up = decide(policy, view, early.recheck_at, **kwargs)
    assert (up.action, up.members) == (Action.SCALE_UP, expected)
    assert f"1 -> {len(expected)} replica(s)" in up.reason


def test_arrivals_during_the_stable_period_join_the_held_back_scale_up() -> None:
    events = [ScaleEvent(0.0, 2), ScaleEvent(100.0, 3), ScaleEvent(200.0, 2)]  # gate at 200 + 120
    view = _view(("a", "b"), {"c": 150.0, "d": 300.0}, events)
    held = decide(DEFAULT, view, 310.0)
    assert (held.action, held.recheck_at) == (Action.NONE, 320.0)
    assert "scale-up to 4 replica(s) held back" in held.reason
    assert decide(DEFAULT, view, 320.0).members == ("a", "b", "c", "d")


def test_a_node_that_has_not_arrived_yet_is_not_admitted() -> None:
    view = _view(("a",), {"s": 0.0, "late": 500.0}, [ScaleEvent(0.0, 1)])
    assert decide(DEFAULT, view, 100.0).members == ("a", "s")
