"""Aborting a broken gloo group by shutting down its sockets (elastic_events.rounds.abort)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_events.control import ControlReader, ControlWriter, EventKind
from elastic_events.rounds import abort
from elastic_events.rounds.watchdog import GlooAbort, Watchdog
from support.cluster import wait_until

WORKER = Path(__file__).resolve().parent / "workers" / "blocked_collective.py"


@pytest.fixture
def pair():
    """Two connected sockets formed as round 5's (both ends live in this process)."""
    abort.begin_round(5)
    with abort.tracking():
        a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()
    abort.begin_round(0)


def test_shutting_down_a_round_ends_a_wait_on_its_sockets(pair) -> None:
    a, b = pair
    untracked_a, untracked_b = socket.socketpair()
    with untracked_a, untracked_b:
        assert abort.shutdown_round(5) == 2
        assert b.recv(1) == b""  # what a blocked reader sees: the connection closed
        untracked_a.sendall(b"x")  # a socket opened outside the round's forming is left alone
        assert untracked_b.recv(1) == b"x"
    assert abort.shutdown_round(5) == 0  # once


def test_a_round_is_never_shut_down_once_the_next_one_began_forming(pair) -> None:
    a, b = pair
    abort.begin_round(6)
    assert abort.shutdown_round(5) == 0
    a.sendall(b"y")
    assert b.recv(1) == b"y"


def _publish(writer: ControlWriter, *, event_id: int, round: int, repair: bool) -> None:
    writer.publish(
        event_id=event_id, target_step=0, kind=EventKind.RECONFIGURE, round=round, world_size=1, repair=repair
    )


def test_the_watch_acts_only_on_a_repair_of_the_current_round_not_taken_up(pair, tmp_path) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    reader = ControlReader(tmp_path / "ctl", 0)
    watch = Watchdog(reader, abort=GlooAbort(), on_broken=lambda round, why: None)  # polled by hand: no thread
    assert watch.poll_once(0.0) == 0  # no event
    _publish(writer, event_id=1, round=6, repair=False)
    assert watch.poll_once(0.1) == 0  # a cooperative event: the loop acts at its step
    _publish(writer, event_id=2, round=5, repair=True)
    assert watch.poll_once(0.2) == 0  # not a later round
    _publish(writer, event_id=3, round=6, repair=True)
    reader.acknowledge(3)
    assert watch.poll_once(0.3) == 0  # the loop took it up: it is in recover() already
    _publish(writer, event_id=4, round=6, repair=True)
    assert watch.poll_once(0.4) == 2
    assert pair[1].recv(1) == b""


def test_a_rank_that_stays_blocked_hands_off_once_after_a_few_of_its_step_times(pair, tmp_path) -> None:
    """The rank stepped once a second: it counts as blocked 3 step times after the repair appeared, not before."""
    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    reader = ControlReader(tmp_path / "ctl", 0)
    blocked: list[int] = []
    watch = Watchdog(
        reader,
        abort=GlooAbort(),
        on_broken=lambda round, why: None,
        on_blocked=lambda event: blocked.append(event.event_id),
    )
    for now in (0.0, 1.0, 2.0):  # three steps, one per second
        reader.check()
        watch.poll_once(now)
    assert watch.blocked_after_s() == pytest.approx(3.0)
    _publish(writer, event_id=7, round=6, repair=True)
    assert watch.poll_once(2.5) == 2  # the sockets go at once
    watch.poll_once(5.0)
    assert blocked == []  # 2.5 s: the loop may still be computing its step
    watch.poll_once(5.6)
    watch.poll_once(9.0)
    assert blocked == [7]  # once
    reader.acknowledge(7)  # the loop reached recover() after all
    _publish(writer, event_id=8, round=7, repair=True)
    abort.begin_round(6)
    watch.poll_once(10.0)
    watch.poll_once(20.0)
    assert blocked == [7, 8]  # a new repair is watched afresh


def test_the_step_time_is_floored_for_fast_loops(tmp_path) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    reader = ControlReader(tmp_path / "ctl", 0)
    watch = Watchdog(reader, abort=GlooAbort(), on_broken=lambda round, why: None)
    for i in range(5):
        reader.set_step(i * 1000)
        watch.poll_once(i * 0.02)
    assert watch.blocked_after_s() == Watchdog.BLOCKED_MIN_S
    del writer


@pytest.mark.parametrize("how", ["tracked", "init_process_group"])
def test_a_rank_blocked_on_a_live_peer_is_freed_when_the_launcher_publishes_a_repair(tmp_path, how) -> None:
    """Rank 1 waits in an all_reduce that rank 0 (alive, holding the group) never joins: gloo alone
    would wait out the group's 60 s timeout; the repair event ends it at once, as a peer failure. The
    group formed as a round engine forms it, or by the script with elastic_events.init_process_group."""
    writer = ControlWriter(tmp_path / "ctl", nproc=2)
    env = {**os.environ, "HYPERPODRUN_ROUND": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(rank), str(tmp_path / "ctl"), how], env=env)
        for rank in (0, 1)
    ]
    try:
        wait_until(
            lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), timeout=60, what="both ranks' group"
        )
        _publish(writer, event_id=1, round=2, repair=True)
        wait_until(lambda: (tmp_path / "result.json").exists(), timeout=20, what="rank 1's all_reduce to end")
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["raised"] and result["round_broken"], result
        assert result["seconds"] < 20, result  # the group's timeout is 60 s
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()


def test_a_connection_of_the_round_that_a_peer_closed_or_that_gloo_closed_is_a_peer_failure() -> None:
    """Evidence of a peer's failure from the round's own connections, not from an error's words."""
    abort.begin_round(9)
    with abort.tracking():
        a, b = socket.socketpair()
        c, d = socket.socketpair()
    try:
        assert not abort.peer_closed(9)  # open, nothing to read
        b.sendall(b"x")
        assert not abort.peer_closed(9)  # data waiting is no failure
        assert not abort.peer_closed(8)  # another round
        d.close()
        assert abort.peer_closed(9)  # the peer's end closed: end of stream
    finally:
        for s in (a, b, c):
            s.close()
    abort.begin_round(10)
    with abort.tracking():
        e, f = socket.socketpair()
    e.close()  # gloo closes a pair's descriptor once it fails
    try:
        assert abort.peer_closed(10)
    finally:
        f.close()
