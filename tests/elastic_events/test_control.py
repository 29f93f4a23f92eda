"""Control channel v2: at-or-past events, rank slots (capabilities, phase, round), parked admission."""

from __future__ import annotations

import pytest

from elastic_events.control import (
    CAP_RECONFIGURE,
    AdmissionTimeoutError,
    ControlReader,
    ControlWriter,
    EventKind,
    RankPhase,
)


@pytest.fixture
def channel(tmp_path):
    writer = ControlWriter(tmp_path / "ctl", nproc=3)
    yield writer, [ControlReader(tmp_path / "ctl", r) for r in range(3)]
    writer.close()


def test_a_rank_already_past_the_target_fires_once_at_its_next_step(channel) -> None:
    writer, readers = channel
    for reader in readers:
        for _ in range(10):
            assert not reader.check()
    writer.publish(event_id=1, target_step=8, kind=EventKind.SAVE_AND_EXIT, round=2, world_size=4)
    fired = [[step for step in range(11, 16) if reader.check()] for reader in readers]
    assert fired == [[11], [11], [11]]  # an exact match on 8 would never fire
    assert [p.acked_event for p in writer.progress()] == [1, 1, 1]


def test_each_event_fires_once_and_the_next_event_fires_again(channel) -> None:
    writer, readers = channel
    reader = readers[0]
    writer.publish(
        event_id=1,
        target_step=3,
        kind=EventKind.RECONFIGURE,
        round=1,
        world_size=2,
        group_rank=0,
        group_world_size=2,
        master_addr="127.0.0.1",
        master_port=1234,
    )
    assert [reader.check() for _ in range(6)] == [False, False, True, False, False, False]
    assert (reader.fired.event_id, reader.fired.master_port) == (1, 1234)
    writer.publish(
        event_id=2,
        target_step=9,
        kind=EventKind.RECONFIGURE,
        round=2,
        world_size=3,
        group_rank=1,
        group_world_size=3,
        master_addr="node-a",
        master_port=4321,
    )
    assert [reader.check() for _ in range(4)] == [False, False, True, False]
    event = reader.event()
    assert (event.event_id, event.round, event.world_size, event.group_rank, event.group_world_size) == (2, 2, 3, 1, 3)
    assert (event.master_addr, event.master_port, event.leaves) == ("node-a", 4321, False)
    writer.clear()
    assert reader.event() is None and writer.event() is None


def test_slot_fields_reach_the_agent(channel) -> None:
    writer, readers = channel
    assert [(p.phase, p.capabilities, p.snapshot_step) for p in writer.progress()] == [(RankPhase.STARTING, 0, -1)] * 3
    readers[1].declare(CAP_RECONFIGURE)
    readers[1].set_phase(RankPhase.READY, round=7)
    readers[2].set_step(41)
    progress = writer.progress()
    assert progress[1].reconfigurable and not progress[0].reconfigurable
    assert (progress[1].phase, progress[1].round) == (RankPhase.READY, 7) and progress[1].phase_time > 0
    assert progress[2].step == 41 and readers[2].check() is False and writer.progress()[2].step == 42
    assert readers[1].progress() == writer.progress()[1]
    writer.reset_ranks()
    assert writer.progress()[1].phase is RankPhase.STARTING and not writer.progress()[1].reconfigurable


def test_parked_rank_is_admitted_only_by_a_reconfigure_that_places_its_node(channel) -> None:
    writer, readers = channel
    published = []

    def sleep(_: float) -> None:  # the agent's writes, interleaved with the rank's polls
        step = len(published)
        if step == 0:
            writer.publish(event_id=1, target_step=5, kind=EventKind.SAVE_AND_EXIT, round=1, world_size=2)
        elif step == 1:
            writer.publish(
                event_id=2,
                target_step=5,
                kind=EventKind.RECONFIGURE,
                round=2,
                world_size=2,
                group_rank=-1,
                group_world_size=2,
            )
        elif step == 2:
            writer.publish(
                event_id=3,
                target_step=9,
                kind=EventKind.RECONFIGURE,
                round=3,
                world_size=6,
                group_rank=2,
                group_world_size=3,
                master_addr="127.0.0.1",
                master_port=29500,
            )
        published.append(step)
        assert writer.progress()[0].phase is RankPhase.PARKED

    event = readers[0].wait_for_admission(timeout_s=60, sleep=sleep)
    assert (event.event_id, event.round, event.group_rank, event.master_port) == (3, 3, 2, 29500)
    assert writer.progress()[0].acked_event == 3
    readers[0].set_step(9)
    assert readers[0].check() is False  # the admitting event does not fire again


def test_parked_rank_times_out_with_a_clear_error(channel) -> None:
    _, readers = channel
    now = [0.0]

    def sleep(dt: float) -> None:
        now[0] += dt

    with pytest.raises(AdmissionTimeoutError, match="not admitted into a round within 2s"):
        readers[0].wait_for_admission(timeout_s=2, poll_s=0.5, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 2.0


def test_publish_rejects_bad_round_descriptions(channel) -> None:
    writer, _ = channel
    with pytest.raises(ValueError, match="master_addr"):
        writer.publish(
            event_id=1,
            target_step=1,
            kind=EventKind.RECONFIGURE,
            round=1,
            world_size=1,
            group_rank=0,
            master_addr="x" * 129,
            master_port=1,
        )
    with pytest.raises(ValueError, match="needs master_addr and master_port"):
        writer.publish(event_id=1, target_step=1, kind=EventKind.RECONFIGURE, round=1, world_size=1, group_rank=0)
    assert writer.event() is None


def test_the_agent_never_reads_half_a_slot_while_a_rank_steps_at_full_speed(tmp_path) -> None:
    """Found by the unpadded elastic tests: a read caught half of a rank's write (step new, time
    garbage), and hang detection declared a rank stepping 13,000 times a second hung for 57 years."""
    import subprocess
    import sys
    import time as _time

    from elastic_events.control import ControlWriter

    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    code = (
        "import sys, time; from pathlib import Path; from elastic_events.control import ControlReader\n"
        f"r = ControlReader(Path({str(tmp_path / 'ctl')!r}), 0); end = time.monotonic() + 3\n"
        "while time.monotonic() < end: r.check()\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code])
    try:
        start, bad, reads = _time.monotonic(), [], 0
        while rank.poll() is None:
            p = writer.progress()[0]
            reads += 1
            if p.step > 0 and not start - 1 <= p.time <= _time.monotonic() + 1:
                bad.append((p.step, p.time))
    finally:
        rank.wait(10)
        writer.close()
    assert reads > 1000 and not bad, bad[:5]
