"""Embedded-only behaviour: hosting, losing the host, binding, and the state's lease clock."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hyperpodrun.store import (
    BACKENDS,
    EmbeddedHostNotLocalError,
    EmbeddedStoreClient,
    EmbeddedStoreGoneError,
    EmbeddedStoreServer,
    Entry,
    LeaseExpiredError,
    LeaseKeeper,
    PrefixedStore,
    StoreAddressInUseError,
    StoreConfigError,
    StoreError,
    StoreUnavailableError,
    create_store,
)
from hyperpodrun.store.embedded import KeyValueState
from support.etcd import EtcdServer
from support.ports import free_port

WAIT = 30.0


@pytest.fixture
def server() -> Iterator[EmbeddedStoreServer]:
    with EmbeddedStoreServer("127.0.0.1", 0) as server:
        yield server


def _gone_message(endpoint: str) -> str:
    return (
        f"embedded store hosted at {endpoint} is gone (the agent that hosted it exited); "
        "the job cannot outlive its host agent — use --rdzv-backend etcd for that"
    )


# --------------------------------------------------------------------------- losing the host


def test_clients_learn_the_host_is_gone() -> None:
    server = EmbeddedStoreServer("127.0.0.1", 0).start()
    endpoint = server.endpoint
    client = EmbeddedStoreClient(endpoint)
    rev = client.put("k", b"v")
    waiting: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait_for_change("nothing/", after_revision=rev, timeout=WAIT)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            waiting.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    server.close()  # the hosting agent exits
    waiter.join(WAIT)

    assert not waiter.is_alive()
    assert len(waiting) == 1 and isinstance(waiting[0], EmbeddedStoreGoneError)
    with pytest.raises(EmbeddedStoreGoneError) as info:
        client.get("k")
    assert str(info.value) == _gone_message(endpoint)
    assert isinstance(info.value, StoreUnavailableError) and info.value.endpoint == endpoint
    client.close()


def test_lease_keeper_gives_up_a_ttl_after_the_host_is_gone() -> None:
    server = EmbeddedStoreServer("127.0.0.1", 0).start()
    with EmbeddedStoreClient(server.endpoint) as client:
        lease = client.grant_lease(0.6)
        lost = threading.Event()
        keeper = LeaseKeeper(lease, on_lost=lambda error: lost.set()).start()
        server.close()
        started = time.monotonic()
        assert lost.wait(WAIT)
        keeper.stop()
    # It retried while the lease could still be alive on the server, then gave up.
    assert time.monotonic() - started >= 0.6 - keeper.interval - 0.05
    assert isinstance(keeper.error, LeaseExpiredError)
    assert "no successful refresh" in str(keeper.error) and "is gone" in str(keeper.error)


def test_client_before_any_host_is_unreachable_within_the_bound() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        EmbeddedStoreClient(endpoint, connect_timeout=0.5)
    assert 0.45 <= time.monotonic() - started < 0.5 + 4.0
    assert str(info.value).startswith(f"embedded store at {endpoint} is unreachable after 0.5s: connection refused")
    assert not isinstance(info.value, EmbeddedStoreGoneError)


def test_something_else_on_the_port_is_not_taken_for_a_store(etcd_server: EtcdServer) -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"{etcd_server.endpoint} does not answer as an embedded store"):
        EmbeddedStoreClient(etcd_server.endpoint, connect_timeout=1.0)
    assert time.monotonic() - started < 1.0 + 4.0


# --------------------------------------------------------------------------- binding


def test_second_host_on_the_same_address_is_refused(server: EmbeddedStoreServer) -> None:
    with pytest.raises(StoreAddressInUseError) as info:
        EmbeddedStoreServer("127.0.0.1", server.address[1]).start()
    assert info.value.endpoint == server.endpoint
    assert "already in use" in str(info.value)


def test_create_store_hosts_or_joins(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with create_store("c10d", endpoint, run_id=run_id, conf={}, timeout=5.0) as first:
        # The first agent hosts; the next one finds the address taken and joins it.
        with create_store("embedded", endpoint, run_id=run_id, conf={}, timeout=5.0) as second:
            assert isinstance(first, PrefixedStore) and isinstance(second, PrefixedStore)
            assert first.inner.is_host and not second.inner.is_host
            rev = second.put("members/1", b"b")
            assert first.get("members/1") == Entry(b"b", rev)
            with pytest.raises(StoreAddressInUseError):
                create_store("embedded", endpoint, run_id=run_id, conf={}, host=True, timeout=5.0)
    # Closing the hosting agent's store ended the store.
    with pytest.raises(StoreUnavailableError):
        create_store("embedded", endpoint, run_id=run_id, conf={}, host=False, timeout=0.3)


def test_server_binds_only_the_host_it_is_given(server: EmbeddedStoreServer) -> None:
    port = server.address[1]
    assert server.address == ("127.0.0.1", port)
    # 127.0.0.2 is this machine too: a wildcard listener would accept there.
    with socket.create_server(("0.0.0.0", 0)) as wildcard:
        socket.create_connection(("127.0.0.2", wildcard.getsockname()[1]), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


def test_non_local_address_means_another_node_hosts() -> None:
    endpoint = "192.0.2.1:29400"  # TEST-NET-1: never an address of this machine
    env = {"HYPERPODRUN_STORE_SECRET": "s" * 32}
    with pytest.raises(EmbeddedHostNotLocalError, match="not an address of this machine"):
        create_store("embedded", endpoint, run_id="job", conf={}, host=True, timeout=0.3, env=env)
    with pytest.raises(StoreUnavailableError, match=f"embedded store at {endpoint} is unreachable"):
        create_store("embedded", endpoint, run_id="job", conf={}, timeout=0.3, env=env)


# --------------------------------------------------------------------------- factory


@pytest.mark.parametrize("backend", ["embedded", "c10d", "static", "C10D"])
def test_torchrun_backends_map_to_the_embedded_store(backend: str, run_id: str) -> None:
    with create_store(backend, "127.0.0.1:0", run_id=run_id, conf={}, host=True, timeout=5.0) as store:
        assert isinstance(store, PrefixedStore) and isinstance(store.inner, EmbeddedStoreClient)
        assert store.inner.is_host
        assert store.prefix == f"/hyperpodrun/v1/{run_id}/"


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(StoreConfigError) as info:
        create_store("zookeeper", "127.0.0.1:0", run_id="job", conf={}, timeout=1.0)
    assert str(info.value) == f"unknown --rdzv-backend 'zookeeper'; valid backends: {', '.join(BACKENDS)}"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("run_id", "conf", "match"),
    [
        ("job", {"cacert": "/ca.pem"}, r"--rdzv-conf cacert=\.\.\. applies only to --rdzv-backend etcd"),
        ("job/../other", {}, r"--rdzv-id 'job/\.\./other' is not a valid job id"),
        ("", {}, r"--rdzv-id must be a non-empty string"),
    ],
)
def test_bad_embedded_configuration(run_id: str, conf: dict[str, str], match: str) -> None:
    with pytest.raises(StoreConfigError, match=match):
        create_store("embedded", "127.0.0.1:0", run_id=run_id, conf=conf, host=True, timeout=1.0)


# --------------------------------------------------------------------------- state, on a fake clock


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_expires_exactly_at_its_deadline_and_refresh_moves_it() -> None:
    clock = FakeClock()
    state = KeyValueState(clock=clock)
    lease_id, ttl = state.grant_lease(10.0)
    state.put("leased", b"1", lease_id=lease_id)
    state.put("plain", b"2")

    clock.now += 9.999
    assert state.refresh_lease(lease_id) == ttl == 10.0
    clock.now += 9.999
    assert state.expire_leases() == 0 and state.get("leased") is not None
    before = state.revision()
    clock.now += 0.001
    assert state.expire_leases() == 1
    assert state.get("leased") is None and state.get("plain") is not None
    assert state.revision() == before + 1
    with pytest.raises(LeaseExpiredError):
        state.refresh_lease(lease_id)


def test_expiry_is_applied_lazily_by_any_operation() -> None:
    clock = FakeClock()
    state = KeyValueState(clock=clock)
    lease_id, _ = state.grant_lease(1.0)
    rev = state.put("a/k", b"v", lease_id=lease_id)
    clock.now += 1.0
    # No reaper ran, but neither a read nor a wait can observe the stale key.
    assert state.get_prefix("a/") == {}
    assert state.wait_for_change("a/", after_revision=rev, timeout=0.0) == rev + 1


def test_overwriting_a_leased_key_detaches_it_from_the_lease() -> None:
    clock = FakeClock()
    state = KeyValueState(clock=clock)
    lease_id, _ = state.grant_lease(1.0)
    state.put("k", b"leased", lease_id=lease_id)
    rev = state.put("k", b"plain")
    clock.now += 5.0
    assert state.expire_leases() == 1
    assert state.get("k") == Entry(b"plain", rev)


def test_wait_from_before_the_kept_history_reports_a_change() -> None:
    state = KeyValueState(clock=FakeClock(), history=2)
    first = state.put("watched/k", b"1")
    state.put("x", b"2")
    state.put("y", b"3")  # "watched/k" has fallen out of the history
    latest = state.put("z", b"4")
    assert state.wait_for_change("watched/", after_revision=first - 1, timeout=0.0) == latest
    # Within the kept history the answer stays exact.
    assert state.wait_for_change("watched/", after_revision=latest - 1, timeout=0.0) is None
