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
    ("held_s", "step_s", "target", "every"),
    [
        (0.0, 0.5, 0.02, 1),  # free: every step
        (0.01, 0.5, 0.02, 1),  # exactly the budget of one step
        (0.011, 0.5, 0.02, 2),
        (1.2, 0.03, 0.02, 2000),  # 2 GB at 1.8 GB/s behind a 30 ms step (the H100 check's case)
        (0.3, 0.1, 0.05, 60),
    ],
)
def test_the_interval_is_the_smallest_within_the_target(held_s, step_s, target, every) -> None:
    choice = choose_interval(held_s=held_s, step_s=step_s, target=target)
    assert (choice.every, choice.rule) == (every, "cost")
    assert choice.overhead <= target + 1e-12
    if every > 1:  # one step fewer would cost more than the target
        assert held_s / ((every - 1) * step_s) > target


def test_a_known_failure_rate_lengthens_the_interval_to_youngs() -> None:
    held, step, mtbf = 0.01, 0.5, 3600.0
    choice = choose_interval(held_s=held, step_s=step, target=0.02, mtbf_s=mtbf)
    assert choice.rule == "young" and choice.every == round(math.sqrt(2 * held * mtbf) / step) == 17
    # where the cost rule asks for more steps than Young's, it wins
    assert choose_interval(held_s=1.0, step_s=0.5, target=0.02, mtbf_s=600.0).every == 100  # Young: 69


def test_the_choice_says_what_a_failure_costs() -> None:
    text = choose_interval(held_s=0.03, step_s=0.5, target=0.02).describe()
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
    """Takes snapshots instantly; :meth:`wait` reports a held time the test sets."""

    clock: list[float]
    held_next: float = 0.0
    taken: list[int] = field(default_factory=list)
    failed: BaseException | None = None

    def snapshot(self, piece: int) -> None:
        self.taken.append(piece)

    def wait(self, *, broken: Any) -> None:
        self.clock[0] += self.held_next


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


def run_steps(snapshots: Snapshots, clock: list[float], state: SimpleNamespace, steps: int, step_s: float) -> None:
    """``steps`` steps of ``step_s`` seconds each: the optimizer step's wait, then the step's end."""
    for _ in range(steps):
        clock[0] += step_s
        snapshots.wait()
        state.step += 1
        snapshots.take()


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch):
    clock = [100.0]
    monkeypatch.setattr("elastic_events.rounds.snapshots.time.monotonic", lambda: clock[0])
    engine = FakeEngine(ElasticConfig(snapshot_every=AUTO, snapshot_overhead=0.02), peers=[(0.004, 0.12)])
    state = SimpleNamespace(step=10)
    snapshots = Snapshots(engine, state)  # type: ignore[arg-type]
    replicator = FakeReplicator(clock)
    snapshots.replicator = replicator  # type: ignore[assignment]
    snapshots.piece = lambda step: step  # type: ignore[method-assign,assignment,return-value]
    # what start() does once its replicator exists: calibrate this round, snapshot the round's first state
    snapshots.every, snapshots.choice, snapshots._calibration = 1, None, Calibration.empty()
    snapshots.take(every=1)
    snapshots._last_take, snapshots._start_s = None, None
    return snapshots, replicator, engine, state, clock


def test_auto_times_the_rounds_first_steps_then_agrees_on_the_slowest(faked) -> None:
    snapshots, replicator, engine, state, clock = faked
    replicator.held_next = 0.006  # each optimizer step waits 6 ms for the last snapshot
    run_steps(snapshots, clock, state, CALIBRATION_STEPS, step_s=0.1)
    assert snapshots.choice is None and replicator.taken == [10, 11, 12]  # every step while timing
    run_steps(snapshots, clock, state, 1, step_s=0.1)
    # this rank: held 6 ms, step 100 ms; a peer: held 4 ms, step 120 ms -> 6 ms against 100 ms
    assert engine.agreed == [pytest.approx((0.006, 0.1))]
    assert snapshots.choice is not None and snapshots.choice.held_s == pytest.approx(0.006)
    assert snapshots.choice.step_s == pytest.approx(0.1)
    assert snapshots.every == 3 == snapshots.choice.every  # ceil(0.006 / (0.02 * 0.1))
    replicator.held_next = 0.0
    run_steps(snapshots, clock, state, 8, step_s=0.1)  # steps 14-21 (the choice was made after step 13)
    assert replicator.taken == [10, 11, 12, 15, 18, 21]  # every 3rd step from the choice on
    assert len(engine.agreed) == 1  # one agreement per round


def test_a_fixed_interval_never_times_or_agrees(faked) -> None:
    snapshots, replicator, engine, state, clock = faked
    engine.config = ElasticConfig(snapshot_every=2)
    fixed = Snapshots(engine, state)  # type: ignore[arg-type]
    fixed.replicator, fixed.piece = replicator, lambda step: step  # type: ignore[assignment,method-assign]
    replicator.taken.clear()
    run_steps(fixed, clock, state, 5, step_s=0.1)
    assert not fixed.auto and fixed.choice is None and engine.agreed == []
    assert replicator.taken == [12, 14]


def test_the_rounds_first_snapshot_and_step_are_not_timed(faked) -> None:
    """The round's first snapshot may lack the optimizer's state, and its first step builds a loader
    iterator: neither is part of the measurement."""
    snapshots, replicator, engine, state, clock = faked
    replicator.held_next = 0.5  # the round's first snapshot: slow
    clock[0] += 3.0  # a slow first step
    snapshots.wait()
    state.step += 1
    snapshots.take()
    replicator.held_next = 0.002
    run_steps(snapshots, clock, state, CALIBRATION_STEPS, step_s=0.1)
    assert engine.agreed == [pytest.approx((0.002, 0.1))]
    assert snapshots.choice is not None and snapshots.choice.held_s == 0.004  # the peer's slower snapshot
    assert snapshots.every == 2  # 4 ms over 2 % of 100 ms
