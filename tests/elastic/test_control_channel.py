"""elastic_event_detected() and the control channel, and the choice of the target step (pure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_events.control import ControlReader, ControlWriter, EventKind
from hyperpodrun.rendezvous.decider import choose_target_step


def test_outside_hyperpodrun_it_is_false(monkeypatch) -> None:
    code = (
        "import os, elastic_events as e\n"
        "assert 'HYPERPODRUN_CONTROL_FILE' not in os.environ\n"
        "print(sum(e.elastic_event_detected() for _ in range(1000)), e.current_event(), e.restart_reason())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HYPERPODRUN_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["0", "None", "start"]


def test_every_rank_returns_true_exactly_at_the_target_step(tmp_path) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=3)
    readers = [ControlReader(tmp_path / "ctl", r) for r in range(3)]
    fired: dict[int, list[int]] = {r: [] for r in range(3)}
    for step in range(1, 31):
        if step == 5:
            writer.publish(event_id=7, target_step=20, kind=EventKind.SAVE_AND_EXIT, round=3, world_size=6)
        for r, reader in enumerate(readers):
            if reader.check():
                fired[r].append(step)
    assert fired == {0: [20], 1: [20], 2: [20]}
    progress = writer.progress()
    assert [p.step for p in progress] == [30, 30, 30] and [p.acked_event for p in progress] == [7, 7, 7]
    event = readers[1].event()
    assert (event.event_id, event.target_step, event.kind, event.round, event.world_size) == (
        7,
        20,
        EventKind.SAVE_AND_EXIT,
        3,
        6,
    )
    writer.reset_ranks()
    assert writer.event() is None and [p.step for p in writer.progress()] == [0, 0, 0]
    writer.close()


def test_reader_rejects_a_foreign_file(tmp_path) -> None:
    from elastic_events.control import ControlChannelError

    (tmp_path / "junk").write_bytes(b"x" * 256)
    with pytest.raises(ControlChannelError, match="not a hyperpodrun"):
        ControlReader(tmp_path / "junk", 0)
    with pytest.raises(ControlChannelError, match="cannot open"):
        ControlReader(tmp_path / "missing", 0)


@pytest.mark.parametrize(
    ("steps", "times", "propagation", "expected"),
    [
        ([10, 11], [0.1, 0.1], 1.0, 11 + 2 + 10),  # 1 s at 0.1 s/step: 10 steps of margin
        ([10, 11], [0.1, 0.05], 1.0, 11 + 2 + 20),  # the fastest rank sets the margin
        ([5], [2.0], 1.0, 5 + 2 + 1),  # slow steps: at least one step of margin
        ([100, 99], [1e-4], 5.0, 100 + 2 + 50_000),  # fast steps: the margin is time, not a step count
    ],
)
def test_choose_target_step(steps, times, propagation, expected) -> None:
    assert choose_target_step(steps, times, propagation=propagation) == expected


def test_choose_target_step_needs_a_rank_and_known_rates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_target_step([], [], propagation=1.0)
    with pytest.raises(ValueError, match="known step times"):
        choose_target_step([5], [0.0], propagation=1.0)  # the decider defers instead (see test_decider)
