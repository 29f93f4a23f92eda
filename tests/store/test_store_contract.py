"""The behaviour every Store backend must share, run against a real etcd and the embedded server."""

from __future__ import annotations

import threading
import time

import pytest

from hyperpodrun.store import (
    Entry,
    LeaseExpiredError,
    LeaseKeeper,
    Store,
    StoreClosedError,
    StoreError,
)

WAIT = 30.0  # generous bound for waits that should end early: the machine is shared


def test_put_get_and_revisions(store: Store) -> None:
    assert store.get("k") is None
    before = store.current_revision()

    first = store.put("k", b"v1")
    assert first > before
    assert store.get("k") == Entry(b"v1", first)
    assert store.current_revision() == first

    second = store.put("k", b"v2")
    assert second > first
    assert store.get("k") == Entry(b"v2", second)

    every_byte = bytes(range(256))
    third = store.put("binary", every_byte)
    assert store.get("binary") == Entry(every_byte, third)
    store.put("empty", b"")
    assert store.get("empty") is not None and store.get("empty").value == b""


def test_compare_and_swap_create_update_conflict(store: Store) -> None:
    assert store.compare_and_swap("k", b"a", expected_revision=0) is True
    created = store.get("k")
    assert created is not None and created.value == b"a"
    # "must not exist" now fails, and so does a stale or made-up revision.
    assert store.compare_and_swap("k", b"b", expected_revision=0) is False
    assert store.compare_and_swap("k", b"b", expected_revision=created.revision + 1000) is False
    assert store.get("k") == created

    assert store.compare_and_swap("k", b"c", expected_revision=created.revision) is True
    updated = store.get("k")
    assert updated is not None and updated.value == b"c" and updated.revision > created.revision
    assert store.compare_and_swap("k", b"d", expected_revision=created.revision) is False
    assert store.get("k") == updated

    assert store.compare_and_swap("missing", b"x", expected_revision=5) is False
    assert store.get("missing") is None
    with pytest.raises(ValueError, match="expected_revision"):
        store.compare_and_swap("k", b"x", expected_revision=-1)


def test_get_prefix_lists_exactly_the_prefix(store: Store) -> None:
    revs = {key: store.put(key, key.encode()) for key in ["a/1", "a/2", "a/ü/3", "ab/4", "b/5"]}

    assert store.get_prefix("a/") == {k: Entry(k.encode(), revs[k]) for k in ["a/1", "a/2", "a/ü/3"]}
    assert set(store.get_prefix("a")) == {"a/1", "a/2", "a/ü/3", "ab/4"}
    assert set(store.get_prefix("")) == set(revs)
    assert store.get_prefix("c/") == {}


def test_delete_and_delete_prefix(store: Store) -> None:
    for key in ["x/1", "x/2", "x/3", "y/1"]:
        store.put(key, b"v")

    assert store.delete("y/1") is True
    assert store.get("y/1") is None
    assert store.delete("y/1") is False

    before = store.current_revision()
    assert store.delete_prefix("x/") == 3
    assert store.current_revision() == before + 1  # one revision for the whole range
    assert store.get_prefix("") == {}
    assert store.delete_prefix("x/") == 0
    assert store.current_revision() == before + 1


def test_lease_expiry_removes_its_keys_only(store: Store, backend) -> None:
    granted_at = time.monotonic()
    lease = store.grant_lease(backend.lease_ttl)
    assert lease.ttl >= backend.lease_ttl
    store.put("m/leased", b"1", lease=lease)
    store.put("m/plain", b"2")
    rev = store.current_revision()

    changed = store.wait_for_change("m/", after_revision=rev, timeout=lease.ttl + WAIT)

    assert changed is not None and changed > rev
    assert time.monotonic() - granted_at >= lease.ttl - 0.1
    assert store.get("m/leased") is None
    assert store.get("m/plain") is not None
    with pytest.raises(LeaseExpiredError):
        lease.refresh()
    with pytest.raises(LeaseExpiredError):
        store.put("m/again", b"3", lease=lease)
    with pytest.raises(LeaseExpiredError):
        store.compare_and_swap("m/again", b"3", expected_revision=0, lease=lease)
    assert store.get("m/again") is None


def test_lease_keeper_keeps_keys_alive_past_the_ttl(store: Store, backend) -> None:
    lease = store.grant_lease(backend.lease_ttl)
    with LeaseKeeper(lease) as keeper:
        rev = store.put("m/alive", b"1", lease=lease)
        # 1.5 ttl without a change: without refreshes the key would have expired.
        assert store.wait_for_change("m/", after_revision=rev, timeout=1.5 * lease.ttl) is None
        assert store.get("m/alive") == Entry(b"1", rev)
        assert not keeper.lost and keeper.error is None
    lease.revoke()
    assert store.get("m/alive") is None


def test_revoke_deletes_keys_at_once(store: Store, backend) -> None:
    lease = store.grant_lease(backend.lease_ttl)
    store.put("r/1", b"1", lease=lease)
    store.put("r/2", b"2", lease=lease)
    before = store.current_revision()

    lease.revoke()

    assert store.get_prefix("r/") == {}
    assert store.current_revision() == before + 1
    lease.revoke()  # already gone: a no-op
    with pytest.raises(LeaseExpiredError):
        lease.refresh()


def test_lease_keeper_reports_a_lost_lease(store: Store, backend) -> None:
    lease = store.grant_lease(backend.lease_ttl)
    calls: list[StoreError] = []
    keeper = LeaseKeeper(lease, on_lost=calls.append).start()
    try:
        lease.revoke()  # e.g. an operator removed the node
        assert keeper.wait_lost(WAIT)
    finally:
        keeper.stop()
    assert isinstance(keeper.error, LeaseExpiredError) and keeper.error.lease_id == lease.id
    assert calls == [keeper.error]


@pytest.mark.parametrize("change", ["put", "delete"])
def test_wait_for_change_wakes_on_change_under_prefix(store: Store, change: str) -> None:
    store.put("w/k", b"0")
    rev = store.current_revision()
    result: list[int | None] = []
    waiter = threading.Thread(
        target=lambda: result.append(store.wait_for_change("w/", after_revision=rev, timeout=WAIT))
    )
    waiter.start()
    store.put("elsewhere/k", b"not watched")
    changed_at = store.put("w/k", b"1") if change == "put" else None
    if change == "delete":
        assert store.delete("w/k")
        changed_at = store.current_revision()
    waiter.join(WAIT + 10)

    assert not waiter.is_alive()
    assert result and result[0] is not None and result[0] >= changed_at


def test_wait_for_change_ignores_other_prefixes_and_old_revisions(store: Store) -> None:
    rev = store.put("w/k", b"0")
    store.put("wx", b"sibling key, not under 'w/'")
    store.put("other/k", b"1")
    started = time.monotonic()
    assert store.wait_for_change("w/", after_revision=rev, timeout=0.5) is None
    assert 0.45 <= time.monotonic() - started < 0.5 + WAIT
    # A change at exactly after_revision is already seen; one after it counts.
    assert store.wait_for_change("w/", after_revision=rev - 1, timeout=0.5) == store.current_revision()


def test_wait_for_change_returns_changes_made_before_the_call(store: Store) -> None:
    rev = store.current_revision()
    store.put("h/1", b"x")
    store.put("unrelated", b"y")
    started = time.monotonic()
    assert store.wait_for_change("h/", after_revision=rev, timeout=WAIT) == store.current_revision()
    assert time.monotonic() - started < WAIT / 2


def test_concurrent_compare_and_swap_has_one_winner(backend, run_id: str) -> None:
    stores = [backend.open(run_id) for _ in range(4)]
    barrier = threading.Barrier(len(stores), timeout=WAIT)
    wins: dict[str, list[bool]] = {"create": [], "update": []}

    def contend(i: int, store: Store) -> None:
        barrier.wait()
        wins["create"].append(store.compare_and_swap("leader", f"{i}".encode(), expected_revision=0))
        barrier.wait()
        entry = store.get("leader")
        assert entry is not None
        barrier.wait()  # everyone read the same revision before anyone writes
        wins["update"].append(store.compare_and_swap("leader", f"{i}+".encode(), expected_revision=entry.revision))

    threads = [threading.Thread(target=contend, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    assert sorted(wins["create"]) == [False, False, False, True]
    assert sorted(wins["update"]) == [False, False, False, True]
    final = stores[0].get("leader")
    assert final is not None and final.value.endswith(b"+")


def test_jobs_sharing_a_store_do_not_see_each_other(backend, make_run_id) -> None:
    job_a, job_b = backend.open(make_run_id()), backend.open(make_run_id())
    job_a.put("members/0", b"a")
    rev_b = job_b.put("members/0", b"b")

    assert job_a.get("members/0") is not None and job_a.get("members/0").value == b"a"
    assert job_b.get_prefix("") == {"members/0": Entry(b"b", rev_b)}
    assert job_a.wait_for_change("members/", after_revision=job_a.current_revision(), timeout=0.01) is None
    job_a.put("members/1", b"a")
    assert job_b.wait_for_change("", after_revision=rev_b, timeout=0.5) is None
    assert job_a.delete_prefix("") == 2
    assert job_b.get_prefix("") == {"members/0": Entry(b"b", rev_b)}


def test_closed_store_refuses_calls(backend, run_id: str) -> None:
    store = backend.open(run_id)
    store.put("k", b"v")
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.get("k")


def test_close_ends_a_wait_in_flight(backend, run_id: str) -> None:
    store = backend.open(run_id)
    rev = store.current_revision()
    errors: list[StoreError] = []

    def wait() -> None:
        try:
            store.wait_for_change("quiet/", after_revision=rev, timeout=WAIT)
        except StoreError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    started = time.monotonic()
    store.close()  # e.g. the agent shutting down while its watch loop waits
    waiter.join(WAIT)
    assert not waiter.is_alive()
    assert time.monotonic() - started < WAIT / 2  # ended by close(), not by its own timeout
    assert len(errors) == 1 and isinstance(errors[0], StoreClosedError)
