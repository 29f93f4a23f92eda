"""The etcd store rides out a real etcd that is restarted or frozen (SIGSTOP) mid-operation.

Each test has its own etcd (restarting the session's would disturb other tests); the
store's timeout (how long etcd may stay unreachable) is well above the outages here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from hyperpodrun.store import EtcdStore, LeaseKeeper, PrefixedStore, StoreUnavailableError, create_store
from hyperpodrun.store.etcd_support import Retry
from support.etcd import EtcdServer

STORE_TIMEOUT = 30.0
WAIT = 60.0


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def open_store(etcd: EtcdServer, run_id: str) -> Iterator[Callable[[], PrefixedStore]]:
    opened: list[PrefixedStore] = []

    def open_() -> PrefixedStore:
        store = create_store("etcd", etcd.endpoint, run_id=run_id, conf={}, timeout=STORE_TIMEOUT)
        assert isinstance(store, PrefixedStore)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


def _in_thread(fn: Callable[[], Any]) -> Future[Any]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def _until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Poll a condition of another thread's progress (there is nothing to wait on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.01)


def test_writes_sent_while_etcd_is_down_land_once_it_is_back(
    etcd: EtcdServer, open_store: Callable[[], PrefixedStore]
) -> None:
    store = open_store()
    rev = store.put("k", b"before")
    etcd.kill()
    put = _in_thread(lambda: store.put("k", b"during"))
    cas = _in_thread(lambda: store.compare_and_swap("fresh", b"mine", expected_revision=0))
    read = _in_thread(lambda: store.get("k"))
    etcd.restart(kill=False)
    assert put.result(WAIT) > rev
    assert cas.result(WAIT) is True
    assert read.result(WAIT) is not None
    assert store.get("k").value == b"during"
    assert store.get("fresh").value == b"mine"


def test_a_client_keeps_reading_and_writing_through_a_restart(
    etcd: EtcdServer, open_store: Callable[[], PrefixedStore]
) -> None:
    store = open_store()
    acknowledged: list[int] = []
    lost_in_flight: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                store.put(f"w/{i}", str(i).encode())
                acknowledged.append(i)
            except StoreUnavailableError as e:  # in flight when etcd died: not resent
                assert "may have been applied" in str(e)
                lost_in_flight.append(str(e))
            assert store.get(f"w/{i}") is not None or lost_in_flight
            i += 1

    running = _in_thread(writer)
    _until(lambda: len(acknowledged) >= 5, "writes before the restart")
    etcd.restart()
    before = len(acknowledged)
    _until(lambda: len(acknowledged) >= before + 5, "writes after the restart")
    stop.set()
    running.result(WAIT)
    assert len(lost_in_flight) <= 1
    stored = store.get_prefix("w/")
    assert all(f"w/{i}" in stored for i in acknowledged)  # every acknowledged write survived


def test_a_waiter_survives_an_etcd_restart_and_still_wakes(
    etcd: EtcdServer, open_store: Callable[[], PrefixedStore]
) -> None:
    store, writer = open_store(), open_store()
    rev = store.current_revision()
    waiter = _in_thread(lambda: store.wait_for_change("round/", after_revision=rev, timeout=WAIT))
    inner = store.inner
    assert isinstance(inner, EtcdStore)
    _until(lambda: bool(inner._watches), "the watch stream to open")
    etcd.restart()
    changed = writer.put("round/1", b"x")
    assert waiter.result(WAIT) == changed


def test_a_change_made_while_the_watch_was_broken_is_not_missed(
    etcd: EtcdServer, open_store: Callable[[], PrefixedStore]
) -> None:
    store = open_store()
    rev = store.current_revision()
    inner = store.inner
    assert isinstance(inner, EtcdStore)
    waiter = _in_thread(lambda: store.wait_for_change("round/", after_revision=rev, timeout=WAIT))
    _until(lambda: bool(inner._watches), "the watch stream to open")
    etcd.kill()
    etcd.restart(kill=False)
    changed = open_store().put("round/1", b"x")  # may land before the waiter watches again
    assert waiter.result(WAIT) == changed


def test_cas_resent_across_a_restart_applies_once(etcd: EtcdServer, open_store: Callable[[], PrefixedStore]) -> None:
    store = open_store()
    rev = store.put("leader", b"old")
    etcd.kill()
    first = _in_thread(lambda: store.compare_and_swap("leader", b"me", expected_revision=rev))
    etcd.restart(kill=False)
    assert first.result(WAIT) is True
    assert store.current_revision() == rev + 1  # exactly one write
    assert not store.compare_and_swap("leader", b"me-again", expected_revision=rev)
    assert store.get("leader").value == b"me"


def test_a_lease_survives_a_5s_pause_when_its_ttl_is_longer(
    etcd: EtcdServer, open_store: Callable[[], PrefixedStore]
) -> None:
    store = open_store()
    lease = store.grant_lease(10)
    store.put("members/me", b"alive", lease=lease)
    with LeaseKeeper(lease) as keeper:
        etcd.pause()
        try:
            time.sleep(5.0)  # the outage itself, not a synchronisation
        finally:
            etcd.resume()
        assert store.get("members/me") is not None
        lease.refresh()
        assert not keeper.lost
    lease.revoke()
    assert store.get("members/me") is None


def test_a_lease_survives_an_etcd_restart(etcd: EtcdServer, open_store: Callable[[], PrefixedStore]) -> None:
    store = open_store()
    lease = store.grant_lease(10)
    store.put("members/me", b"alive", lease=lease)
    with LeaseKeeper(lease) as keeper:
        etcd.restart()
        lease.refresh()
        assert store.get("members/me") is not None
        assert not keeper.lost


def test_cas_whose_reply_was_lost_reports_the_write_it_made(
    open_store: Callable[[], PrefixedStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first copy is applied but its answer never arrives; the resent copy's compare fails."""
    store = open_store()
    inner = store.inner
    assert isinstance(inner, EtcdStore)
    rev = store.put("leader", b"old")
    real_attempt = inner._attempt
    lost: list[str] = []

    def reply_lost(name: str, client: Any, path: str, payload: Any, **kw: Any) -> Any:
        response = real_attempt(name, client, path, payload, **kw)
        if path == "kv/txn" and not lost:
            response.close()
            lost.append(path)
            raise Retry("the server closed the connection without an answer")
        return response

    monkeypatch.setattr(inner, "_attempt", reply_lost)
    assert store.compare_and_swap("leader", b"me", expected_revision=rev) is True
    assert lost == ["kv/txn"] and store.current_revision() == rev + 1
    assert not store.compare_and_swap("leader", b"other", expected_revision=rev)
