"""``--snapshot-every auto``: the interval rule (a pure function), and how :class:`Snapshots` times a
round's first snapshots, agrees with its peers and applies the choice (with a fake replicator and engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_events.contract import AUTO, RankContext, parse_snapshot_every
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.snapshot_interval import CALIBRATION_STEPS, Calibration, choose_interval
from elastic_events.rounds.snapshots import Snapshots


@pytest.mark.parametrize(
    ("cost_s", "step_s", "target", "every"),
    [
        (0.0, 0.5, 0.02, 1),  # free: every step
        (0.01, 0.5, 0.02, 1),  # exactly the budget of one step
        (0.011, 0.5, 0.02, 2),
        (1.2, 0.03, 0.02, 2000),  # 2 GB at 1.8 GB/s behind a 30 ms step (the H100 check's case)
        (0.3, 0.1, 0.05, 60),
    ],
)
def test_the_interval_is_the_smallest_within_the_target(cost_s, step_s, target, every) -> None:
    choice = choose_interval(cost_s=cost_s, step_s=step_s, target=target)
    assert (choice.every, choice.rule) == (every, "cost")
    assert choice.overhead <= target + 1e-12
    if every > 1:  # one step fewer would cost more than the target
        assert cost_s / ((every - 1) * step_s) > target


def test_a_known_failure_rate_lengthens_the_interval_to_youngs() -> None:
    cost, step, mtbf = 0.01, 0.5, 3600.0
    choice = choose_interval(cost_s=cost, step_s=step, target=0.02, mtbf_s=mtbf)
    assert choice.rule == "young" and choice.every == round(math.sqrt(2 * cost * mtbf) / step) == 17
    # where the cost rule asks for more steps than Young's, it wins
    assert choose_interval(cost_s=1.0, step_s=0.5, target=0.02, mtbf_s=600.0).every == 100  # Young: 69


def test_the_choice_says_what_a_failure_costs() -> None:
    text = choose_interval(cost_s=0.03, step_s=0.5, target=0.02).describe()
    assert text.startswith("snapshot every 3 step(s): 30.0 ms per snapshot, step 500.0 ms, overhead 2.00%")
    assert text.endswith("a failure redoes at most 3 step(s)")


@pytest.mark.parametrize(("text", "value"), [("auto", AUTO), (" AUTO ", AUTO), ("0", 0), ("12", 12)])
def test_snapshot_every_reads_auto_or_a_count(text: str, value: object) -> None:
    assert parse_snapshot_every(text) == value


@pytest.mark.parametrize("text", ["-1", "x", "1.5", ""])
def test_snapshot_every_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="expected 'auto' or an integer >= 0"):
        parse_snapshot_every(text)


def test_auto_is_the_default_and_the_launchers_setting_is_read() -> None:
    assert ElasticConfig().snapshot_every is None
    assert RankContext.from_env({}).snapshot_every is None
    assert RankContext.from_env({"HYPERPODRUN_SNAPSHOT_EVERY": "auto"}).snapshot_every == AUTO
    assert ElasticConfig(snapshot_every=3).snapshot_interval == 3


# --------------------------------------------------------------------------- Snapshots, faked


@dataclass
class FakeReplicator:
    """Takes snapshots at once; a step under way while one streams is ``slowdown`` longer, and its optimizer
    step waits ``wait`` for it (what the test sets)."""

    clock: list[float]
    slowdown: float = 0.0
    wait_s: float = 0.0
    taken: list[int] = field(default_factory=list)
    pending: bool = False
    failed: BaseException | None = None

    def snapshot(self, piece: int) -> None:
        self.taken.append(piece)
        self.pending = True

    def wait(self, *, broken: Any) -> None:
        if self.pending:
            self.clock[0] += self.wait_s
        self.pending = False


@dataclass
class FakeEngine:
    config: ElasticConfig
    rank: int = 0
    round: int = 1
    peers: list[tuple[float, float]] = field(default_factory=list)  # the other ranks' reports
    agreed: list[tuple[float, float]] = field(default_factory=list)

    def agree(self, report: tuple[float, float], *, error: type[Exception]) -> list[tuple[float, float]]:
        self.agreed.append(report)
        return [report, *self.peers]

    def broken(self) -> None:
        return None


def run_steps(snapshots: Snapshots, replicator: FakeReplicator, state: SimpleNamespace, steps: int, step_s: float):
    """``steps`` steps of ``step_s`` seconds each (more beside a streaming snapshot): the optimizer step's wait,
    then the step's end."""
    clock = replicator.clock
    for _ in range(steps):
        clock[0] += step_s + (replicator.slowdown if replicator.pending else 0.0)
        snapshots.wait()
        state.step += 1
        snapshots.take()


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch):
    return started_at(monkeypatch, step=10)


def started_at(monkeypatch: pytest.MonkeyPatch, *, step: int):
    """A round of ``auto`` snapshots started at ``step``: the engine, state and replicator faked."""
    clock = [100.0]
    monkeypatch.setattr("elastic_events.rounds.snapshots.time.monotonic", lambda: clock[0])
    engine = FakeEngine(ElasticConfig(snapshot_every=AUTO, snapshot_overhead=0.02), peers=[(0.004, 0.12)])
    state = SimpleNamespace(step=step)
    snapshots = Snapshots(engine, state)  # type: ignore[arg-type]
    replicator = FakeReplicator(clock)
    snapshots.replicator = replicator  # type: ignore[assignment]
    snapshots.piece = lambda step: step  # type: ignore[method-assign,assignment,return-value]
    # what start() does once its replicator exists: calibrate this round, snapshot the round's first state
    snapshots.every, snapshots.choice, snapshots._calibration = 1, None, Calibration.empty()
    snapshots.take(every=1)
    snapshots._last_take = None
    return snapshots, replicator, engine, state


def test_auto_times_steps_with_and_without_a_snapshot_then_agrees_on_the_largest_cost(faked) -> None:
    snapshots, replicator, engine, state = faked
    replicator.slowdown, replicator.wait_s = 0.008, 0.002  # a snapshot: 8 ms taken from the step, 2 ms waited
    run_steps(snapshots, replicator, state, 1 + 2 * CALIBRATION_STEPS - 1, step_s=0.1)
    assert snapshots.choice is None and replicator.taken == [10, 11, 13]  # every other step while timing
    run_steps(snapshots, replicator, state, 1, step_s=0.1)
    # this rank: 10 ms per snapshot, 100 ms a step; a peer: 4 ms, 120 ms -> 10 ms against 100 ms
    assert engine.agreed == [pytest.approx((0.01, 0.1))]
    assert snapshots.choice is not None and snapshots.choice.cost_s == pytest.approx(0.01)
    assert snapshots.choice.step_s == pytest.approx(0.1)
    assert snapshots.every == 5 == snapshots.choice.every  # ceil(0.010 / (0.02 * 0.1))
    assert replicator.taken == [10, 11, 13, 15]  # step 15, the choice's step, is a multiple of 5
    run_steps(snapshots, replicator, state, 10, step_s=0.1)
    assert replicator.taken == [10, 11, 13, 15, 20, 25]  # every 5th step from the choice on
    assert len(engine.agreed) == 1  # one agreement per round


def test_the_first_snapshot_after_the_choice_comes_within_the_chosen_interval(monkeypatch) -> None:
    """Started at step 11, timing snapshots 12 and 14, choosing every 5 at step 16: the next multiple of 5 (20)
    would leave 6 steps since 14, and a failure then would redo more steps than the interval. Step 16 is taken."""
    snapshots, replicator, engine, state = started_at(monkeypatch, step=11)
    replicator.slowdown, replicator.wait_s = 0.008, 0.002
    run_steps(snapshots, replicator, state, 2 * CALIBRATION_STEPS, step_s=0.1)
    assert snapshots.choice is None and replicator.taken == [11, 12, 14]
    run_steps(snapshots, replicator, state, 1, step_s=0.1)
    assert state.step == 16 and snapshots.every == 5
    assert replicator.taken == [11, 12, 14, 16]
    run_steps(snapshots, replicator, state, 10, step_s=0.1)
    assert replicator.taken == [11, 12, 14, 16, 20, 25]
    gaps = [b - a for a, b in zip(replicator.taken, replicator.taken[1:])]
    assert max(gaps) <= snapshots.every


def test_a_snapshot_the_step_hides_is_taken_every_step(faked) -> None:
    snapshots, replicator, engine, state = faked
    engine.peers = []
    run_steps(snapshots, replicator, state, 2 * CALIBRATION_STEPS + 1, step_s=0.1)
    assert engine.agreed == [(0.0, pytest.approx(0.1))] and snapshots.every == 1


def test_a_fixed_interval_never_times_or_agrees(faked) -> None:
    snapshots, replicator, engine, state = faked
    engine.config = ElasticConfig(snapshot_every=2)
    fixed = Snapshots(engine, state)  # type: ignore[arg-type]
    fixed.replicator, fixed.piece = replicator, lambda step: step  # type: ignore[assignment,method-assign]
    replicator.taken.clear()
    run_steps(fixed, replicator, state, 5, step_s=0.1)
    assert not fixed.auto and fixed.choice is None and engine.agreed == []
    assert replicator.taken == [12, 14]


def test_the_rounds_first_step_is_not_timed(faked) -> None:
    """The round's first step builds a loader iterator and waits for the round's first snapshot, which may
    lack the optimizer's state: it is not part of the measurement."""
    snapshots, replicator, engine, state = faked
    replicator.slowdown, replicator.wait_s = 3.0, 0.5  # a slow first step
    run_steps(snapshots, replicator, state, 1, step_s=0.1)
    replicator.slowdown, replicator.wait_s = 0.002, 0.0
    run_steps(snapshots, replicator, state, 2 * CALIBRATION_STEPS, step_s=0.1)
    assert engine.agreed == [pytest.approx((0.002, 0.1))]
    assert snapshots.choice is not None and snapshots.choice.cost_s == 0.004  # the peer's costlier snapshot
    assert snapshots.every == 2  # 4 ms over 2 % of 100 ms


def test_a_failed_agreement_keeps_snapshots_every_step_and_raises_nothing(faked) -> None:
    """The agreement runs after a step, outside its ``with step:`` block: a peer that died there must not end the
    loop with an error; the round is broken and its next step's collective takes the repair path."""
    snapshots, replicator, engine, state = faked

    def agree(report, *, error):
        raise error("peer gone")

    engine.agree = agree  # type: ignore[method-assign]
    run_steps(snapshots, replicator, state, 2 * CALIBRATION_STEPS + 3, step_s=0.1)
    assert snapshots.choice is None and snapshots.every == 1
    assert replicator.taken[-3:] == [state.step - 2, state.step - 1, state.step]
