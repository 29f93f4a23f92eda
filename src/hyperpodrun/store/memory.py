"""The embedded store's data: revisioned keys, leases with deadlines, and a change log.

Pure state behind one lock, with an injected clock: the server in
:mod:`hyperpodrun.store.embedded` serves it over TCP, and tests drive it directly.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable

from hyperpodrun.store.base import Entry, LeaseExpiredError, StoreClosedError, StoreConfigError

__all__ = ["KeyValueState"]


@dataclasses.dataclass(slots=True)
class _Record:
    value: bytes
    revision: int
    lease_id: int  # 0: no lease


@dataclasses.dataclass(slots=True)
class _LeaseRecord:
    ttl: float
    deadline: float
    keys: set[str]


class KeyValueState:
    """The embedded server's data: revisioned keys, leases and a change log.

    Mirrors etcd's semantics: the revision starts at 1 and every write (a put, a delete of
    existing keys, a lease's expiry or revocation) moves it by one. Leases expire on the
    injected monotonic ``clock``; expiry is applied lazily before every operation and by
    waiters, so no reaper thread is needed. The change log keeps the last ``history``
    changes; a wait from before it reports a change (like a compacted etcd watch).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, history: int = 100_000) -> None:
        if history < 1:
            raise StoreConfigError(f"history must be >= 1, got {history!r}")
        self._clock = clock
        self._cond = threading.Condition()
        self._revision = 1
        self._data: dict[str, _Record] = {}
        self._leases: dict[int, _LeaseRecord] = {}
        self._next_lease_id = 1
        self._changes: collections.deque[tuple[int, str]] = collections.deque(maxlen=history)
        self._forgotten_revision = 0
        self._closed = False

    # ---- reads

    def revision(self) -> int:
        with self._cond:
            self._prepare()
            return self._revision

    def get(self, key: str) -> Entry | None:
        with self._cond:
            self._prepare()
            rec = self._data.get(key)
            return None if rec is None else Entry(rec.value, rec.revision)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        with self._cond:
            self._prepare()
            return {k: Entry(r.value, r.revision) for k, r in self._data.items() if k.startswith(prefix)}

    # ---- writes

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        with self._cond:
            self._prepare()
            self._check_lease(lease_id)
            return self._write(key, value, lease_id)

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease_id: int = 0) -> bool:
        with self._cond:
            self._prepare()
            rec = self._data.get(key)
            if (0 if rec is None else rec.revision) != expected_revision:
                return False
            self._check_lease(lease_id)
            self._write(key, value, lease_id)
            return True

    def delete(self, key: str) -> bool:
        with self._cond:
            self._prepare()
            return self._delete([key] if key in self._data else []) == 1

    def delete_prefix(self, prefix: str) -> int:
        with self._cond:
            self._prepare()
            return self._delete([k for k in self._data if k.startswith(prefix)])

    # ---- leases

    def grant_lease(self, ttl: float) -> tuple[int, float]:
        if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"lease ttl must be a finite number > 0, got {ttl!r}")
        with self._cond:
            self._prepare()
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            self._leases[lease_id] = _LeaseRecord(float(ttl), self._clock() + ttl, set())
            return lease_id, float(ttl)

    def refresh_lease(self, lease_id: int) -> float:
        with self._cond:
            self._prepare()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseExpiredError(lease_id)
            lease.deadline = self._clock() + lease.ttl
            return lease.ttl

    def revoke_lease(self, lease_id: int) -> None:
        with self._cond:
            self._prepare()
            self._revoke(lease_id)

    def expire_leases(self) -> int:
        """Apply every expiry due now; returns how many leases expired."""
        with self._cond:
            self._check_open()
            return self._expire_due()

    # ---- change waits

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                self._prepare()
                if self._changed_since(prefix, after_revision):
                    return self._revision
                now = self._clock()
                if now >= deadline:
                    return None
                next_expiry = min((lease.deadline for lease in self._leases.values()), default=deadline)
                self._cond.wait(max(min(deadline, next_expiry) - now, 0.0))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- internals (called with the lock held)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the embedded store server is shutting down")

    def _prepare(self) -> None:
        self._check_open()
        self._expire_due()

    def _expire_due(self) -> int:
        now = self._clock()
        due = [lease_id for lease_id, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in due:
            self._revoke(lease_id)
        return len(due)

    def _check_lease(self, lease_id: int) -> _LeaseRecord | None:
        if lease_id == 0:
            return None
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpiredError(lease_id)
        return lease

    def _revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._delete(sorted(lease.keys))

    def _record_change(self, key: str) -> None:
        if len(self._changes) == self._changes.maxlen:
            self._forgotten_revision = self._changes[0][0]
        self._changes.append((self._revision, key))

    def _write(self, key: str, value: bytes, lease_id: int) -> int:
        self._revision += 1
        old = self._data.get(key)
        if old is not None and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        self._data[key] = _Record(value, self._revision, lease_id)
        if lease_id:
            self._leases[lease_id].keys.add(key)
        self._record_change(key)
        self._cond.notify_all()
        return self._revision

    def _delete(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        self._revision += 1
        for key in keys:
            rec = self._data.pop(key)
            if rec.lease_id in self._leases:
                self._leases[rec.lease_id].keys.discard(key)
            self._record_change(key)
        self._cond.notify_all()
        return len(keys)

    def _changed_since(self, prefix: str, after_revision: int) -> bool:
        if after_revision < self._forgotten_revision:
            return True
        for revision, key in reversed(self._changes):
            if revision <= after_revision:
                return False
            if key.startswith(prefix):
                return True
        return False
