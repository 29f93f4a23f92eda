"""The round engine's parts that need no peer: one device per rank, ending NCCL backends all at once,
the NCCL abort a watchdog runs, and what counts as a peer's failure."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_events.control import ControlReader, ControlWriter, EventKind
from elastic_events.errors import ElasticTrainingError, PeerFailureError, StepAbandonedError
from elastic_events.rounds import abort, engine, group, watchdog
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.engine import RoundEngine, rank_device


def test_each_local_rank_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device(r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ElasticTrainingError, match="local rank 2 has no GPU of its own: 2 visible"):
        rank_device(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device(5) == torch.device("cpu")


class Backend:
    """A communicator whose shutdown or abort takes ``seconds`` (None: never ends)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.calls = seconds, []
        self._never = threading.Event()

    def _end(self, how: str) -> None:
        self.calls.append(how)
        if self.seconds is None:
            self._never.wait()
        else:
            time.sleep(self.seconds)

    def shutdown(self) -> None:
        self._end("shutdown")

    def abort(self) -> None:
        self._end("abort")


@pytest.mark.parametrize("how", ["shutdown", "abort"])
def test_backends_end_all_at_once_not_one_after_another(how: str) -> None:
    """Measured on an H100: 1 s per NCCL abort, taken one after another by torch; four took 3.9 s."""
    backends = [Backend(0.3) for _ in range(4)]
    t0 = time.monotonic()
    assert group.end_backends(backends, how, timeout_s=10) == []
    assert time.monotonic() - t0 < 0.9  # serial: 1.2 s
    assert [b.calls for b in backends] == [[how]] * 4


def test_a_backend_that_never_ends_is_named_and_left_behind_at_the_deadline() -> None:
    backends = [Backend(0.01), Backend(None), Backend(0.01)]
    t0 = time.monotonic()
    assert group.end_backends(backends, "abort", timeout_s=0.3) == [1]
    assert 0.3 <= time.monotonic() - t0 < 1.0


def test_the_nccl_abort_ends_every_backend_of_the_current_round_once(monkeypatch: pytest.MonkeyPatch) -> None:
    backends = [Backend(0.0), Backend(0.0)]
    monkeypatch.setattr(watchdog, "nccl_backends", lambda: backends)
    nccl = watchdog.NcclAbort()
    abort.begin_round(4)
    assert nccl(3) == 0  # an earlier round: its groups are gone already
    assert nccl(4) == 2 and nccl(4) == 0  # the watchdog polls on: once per round
    assert [b.calls for b in backends] == [["abort"], ["abort"]]


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A process group of one rank (gloo), as a round's; torn down after the test."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    abort.begin_round(0)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def channel(tmp_path: Path):
    writer = ControlWriter(tmp_path / "control", 1)
    yield writer, ControlReader(tmp_path / "control", 0)
    writer.close()


def make_engine(reader: ControlReader, grace_s: float = 0.3) -> RoundEngine:
    return RoundEngine(ElasticConfig(device="cpu", peer_failure_grace_s=grace_s, poll_s=0.01), reader=reader)


@pytest.mark.parametrize(
    "exc",
    [dist.DistBackendError("NCCL communicator was aborted"), PeerFailureError("snapshot"), StepAbandonedError(3, "x")],
    ids=["c10d", "peer", "abandoned"],
)
def test_c10d_errors_and_abandoned_steps_are_peer_failures_by_their_type(one_rank_group, channel, exc) -> None:
    e = make_engine(channel[1])
    t0 = time.monotonic()
    assert e.peer_failure(exc) and time.monotonic() - t0 < 0.1


def test_a_runtime_error_with_no_sign_of_a_peer_failure_is_the_scripts_own(one_rank_group, channel, capfd) -> None:
    e = make_engine(channel[1], grace_s=0.3)
    t0 = time.monotonic()
    assert not e.peer_failure(RuntimeError("Connection closed by peer, timeout, nccl, gloo, socket"))
    assert 0.3 <= time.monotonic() - t0 < 1.0  # the message's words do not count; the grace was waited out
    assert "with no sign of a peer's failure within 0.3s: the script's own error" in capfd.readouterr().err
    assert not e.peer_failure(ElasticTrainingError("ours"))


def test_a_runtime_error_in_a_round_the_launcher_repairs_is_a_peer_failure(one_rank_group, channel) -> None:
    writer, reader = channel
    e = make_engine(reader, grace_s=5.0)
    threading.Timer(
        0.1,
        lambda: writer.publish(
            event_id=1, target_step=0, kind=EventKind.RECONFIGURE, round=1, world_size=1, repair=True
        ),
    ).start()
    t0 = time.monotonic()
    assert e.peer_failure(RuntimeError("[gloo] Connection closed by peer"))
    assert time.monotonic() - t0 < 1.0
    assert e.broken() == "the launcher repairs round 0 (event 1): a peer failed"


def test_a_round_aborted_by_its_deadline_is_broken_and_says_why(one_rank_group, channel, capfd) -> None:
    e = make_engine(channel[1])
    assert e.broken() is None
    e.abort_round("its collectives did not complete within 60.0s")
    assert e.broken() == "its collectives did not complete within 60.0s"
    assert e.peer_failure(RuntimeError("anything"))
    assert "rank 0: aborting round 0: its collectives did not complete within 60.0s" in capfd.readouterr().err


def test_the_collective_deadline_follows_the_step_time_above_its_floor(channel, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(engine.time, "monotonic", lambda: now[0])
    e = RoundEngine(
        ElasticConfig(device="cpu", collective_timeout_s=30, collective_timeout_steps=10), reader=channel[1]
    )
    assert e.collective_deadline_s() == 30  # no step yet: the floor
    for _ in range(3):
        e.note_step()
        now[0] += 5.0
    assert e.collective_deadline_s() == pytest.approx(50.0)


def _world_of_one() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)


def test_a_gloo_group_the_script_formed_with_torchs_call_is_said_to_be_unabortable_in_its_first_round(
    channel, capfd
) -> None:
    abort.begin_round(7)  # what the abort knows is another round's: the script formed this group on its own
    dist.init_process_group("gloo", store=_world_of_one(), rank=0, world_size=1)
    e = make_engine(channel[1])
    try:
        assert e.start_group()
        err = capfd.readouterr().err
        assert "formed by torch.distributed.init_process_group" in err and "elastic_events.init_process_group" in err
    finally:
        e.close()  # tears the group down too


def test_a_group_formed_by_elastic_events_init_process_group_is_the_engines_first_round(channel, capfd) -> None:
    group.init_process_group("gloo", store=_world_of_one(), rank=0, world_size=1)
    e = make_engine(channel[1])
    try:
        assert e.start_group() and abort.current_round() == e.round
        assert "init_process_group" not in capfd.readouterr().err
    finally:
        e.close()  # tears the group down too
