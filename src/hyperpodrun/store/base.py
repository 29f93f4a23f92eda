"""The key-value store that rendezvous, membership and the operator CLI are built on.

A :class:`Store` is a small, etcd-v3-shaped interface: every write moves one global,
strictly increasing *revision*; each key remembers the revision of its last write; writes
can be conditional on that revision (compare-and-swap), can be tied to a :class:`Lease` so
that they vanish when their owner stops heartbeating, and any change under a prefix can be
waited for. Two backends implement it: etcd (:mod:`hyperpodrun.store.etcd`) and an embedded
server hosted inside one agent (:mod:`hyperpodrun.store.embedded`).

Waiting for changes without missing any follows one pattern::

    rev = store.current_revision()           # 1. note the revision
    state = store.get_prefix("members/")     # 2. read the state (it includes >= rev)
    ...act on state...
    rev = store.wait_for_change("members/", after_revision=rev, timeout=1.0) or rev

A change that lands between 1 and 2 wakes the wait at once (a harmless extra round);
a change after 2 wakes it as it happens; nothing is lost.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from hyperpodrun.errors import ConfigError, HyperpodrunError
from hyperpodrun.security import run_id_problem

__all__ = [
    "KEY_ROOT",
    "Entry",
    "Lease",
    "LeaseExpiredError",
    "LeaseKeeper",
    "PrefixedStore",
    "Store",
    "StoreAddressInUseError",
    "StoreAuthError",
    "StoreClosedError",
    "StoreConfigError",
    "StoreError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "format_endpoint",
    "job_prefix",
    "parse_endpoint",
]

logger = logging.getLogger(__name__)

#: Every key hyperpodrun writes lives under this root; the ``v1`` names the key layout.
KEY_ROOT = "/hyperpodrun/v1/"


# --------------------------------------------------------------------------- errors


class StoreError(HyperpodrunError):
    """Base class of every error raised by a store."""


class StoreUnavailableError(StoreError):
    """The store's server cannot be reached (or has gone away)."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class StoreTimeoutError(StoreError):
    """A request reached the server but no answer came back in time."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} did not complete within {timeout:g}s")
        self.what = what
        self.timeout = timeout


class StoreAuthError(StoreError):
    """The server refused our credentials or our permissions."""


class StoreConfigError(StoreError, ConfigError):
    """The store was configured wrongly (backend, endpoint, rdzv-conf keys)."""


class StoreClosedError(StoreError):
    """The store (or lease) was used after :meth:`Store.close`."""


class StoreAddressInUseError(StoreError):
    """A store server could not bind its address because something else holds it.

    For the embedded backend this usually means another agent already hosts the store
    at that address, so the caller should connect to it as a client instead.
    """

    def __init__(self, endpoint: str) -> None:
        super().__init__(
            f"cannot host the store at {endpoint}: the address is already in use "
            "(another agent probably hosts it; connect to it as a client)"
        )
        self.endpoint = endpoint


class LeaseExpiredError(StoreError):
    """The lease no longer exists on the server (it expired or was revoked)."""

    def __init__(self, lease_id: int, detail: str = "") -> None:
        suffix = f": {detail}" if detail else ""
        super().__init__(f"lease {lease_id:#x} has expired or was revoked{suffix}")
        self.lease_id = lease_id


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """A key's value and its modification revision (the revision of its last write)."""

    value: bytes
    revision: int


class Lease(abc.ABC):
    """A server-side timer; keys written with it are deleted when it expires or is revoked."""

    def __init__(self, lease_id: int, ttl: float) -> None:
        self._id = lease_id
        self._ttl = ttl

    @property
    def id(self) -> int:
        """Server-assigned identifier."""
        return self._id

    @property
    def ttl(self) -> float:
        """Seconds the lease lives without a :meth:`refresh` (as granted by the server)."""
        return self._ttl

    @abc.abstractmethod
    def refresh(self) -> None:
        """Restart the lease's timer; raises :class:`LeaseExpiredError` if it is gone."""

    @abc.abstractmethod
    def revoke(self) -> None:
        """End the lease now, deleting its keys. Revoking a lease that is gone is a no-op."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id:#x}, ttl={self.ttl:g})"


class Store(abc.ABC):
    """A revisioned key-value store with leases, compare-and-swap and change waits.

    Keys are ``str``, values ``bytes``. Implementations are thread-safe: an agent's lease
    keeper, watch loop and rendezvous share one store.
    """

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The key's entry, or ``None`` if it does not exist."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        """Every key starting with ``prefix``, mapped by its whole key (prefix included)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        """Write unconditionally; returns the new revision (the key's new mod revision)."""

    @abc.abstractmethod
    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        """Write only if the key's mod revision equals ``expected_revision``.

        ``expected_revision=0`` means "only if the key does not exist". Returns whether
        the write happened.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete one key; returns whether it existed."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix`` (one revision); returns how many."""

    @abc.abstractmethod
    def grant_lease(self, ttl: float) -> Lease:
        """Create a lease; the server may round ``ttl`` up (etcd: whole seconds, >= 2 s)."""

    @abc.abstractmethod
    def current_revision(self) -> int:
        """The store's revision now (the revision of its latest write)."""

    @abc.abstractmethod
    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        """Block until a key under ``prefix`` changed at a revision ``> after_revision``.

        Puts, deletes and lease expiries all count; changes that happened before the call
        (but after ``after_revision``) return at once. Returns the store's revision once a
        change is seen (always ``> after_revision``), or ``None`` when ``timeout`` seconds
        pass without one: timing out is a normal outcome for watch loops, not an error.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (and, for a hosting store, the server). Idempotent."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- helpers


def _check_timeout(name: str, value: float) -> None:
    if not value > 0:
        raise StoreConfigError(f"{name} must be > 0 seconds, got {value!r}")


def job_prefix(run_id: str) -> str:
    """The key prefix that scopes one job (``--rdzv-id``), e.g. ``/hyperpodrun/v1/llama/``."""
    if problem := run_id_problem(run_id):
        raise StoreConfigError(problem)
    return f"{KEY_ROOT}{run_id}/"


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(endpoint: str, *, default_port: int) -> tuple[str, int]:
    """Split ``host[:port]`` (``[v6]:port`` for IPv6 literals) into host and port."""
    text = endpoint.strip()
    if "://" in text:
        raise StoreConfigError(
            f"endpoint {endpoint!r} must be host[:port] without a scheme "
            "(use rdzv-conf protocol=https or cacert=... for TLS)"
        )
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise StoreConfigError(f"endpoint {endpoint!r} is not [IPv6]:port")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise StoreConfigError(f"endpoint {endpoint!r}: write IPv6 addresses as [addr]:port")
    else:
        host, port_text = text, ""
    if not host:
        raise StoreConfigError(f"endpoint {endpoint!r} has no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise StoreConfigError(f"endpoint {endpoint!r} has an invalid port {port_text!r}")
    return host, int(port_text)


# --------------------------------------------------------------------------- namespacing


class PrefixedStore(Store):
    """A view of ``inner`` in which every key is relative to ``prefix``.

    Jobs sharing one etcd each get their own view (see :func:`job_prefix`) and cannot see
    each other's keys. Leases and revisions are shared with ``inner``; closing the view
    closes ``inner``.
    """

    def __init__(self, inner: Store, prefix: str) -> None:
        if not prefix:
            raise StoreConfigError("PrefixedStore prefix must be non-empty")
        self.inner = inner
        self.prefix = prefix

    def get(self, key: str) -> Entry | None:
        return self.inner.get(self.prefix + key)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        n = len(self.prefix)
        return {k[n:]: e for k, e in self.inner.get_prefix(self.prefix + prefix).items()}

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        return self.inner.put(self.prefix + key, value, lease=lease)

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        return self.inner.compare_and_swap(self.prefix + key, value, expected_revision=expected_revision, lease=lease)

    def delete(self, key: str) -> bool:
        return self.inner.delete(self.prefix + key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(self.prefix + prefix)

    def grant_lease(self, ttl: float) -> Lease:
        return self.inner.grant_lease(ttl)

    def current_revision(self) -> int:
        return self.inner.current_revision()

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        return self.inner.wait_for_change(self.prefix + prefix, after_revision=after_revision, timeout=timeout)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"PrefixedStore({self.inner!r}, prefix={self.prefix!r})"


# --------------------------------------------------------------------------- lease keeper


def lease_presumed_alive(*, last_refresh: float, now: float, ttl: float) -> bool:
    """Whether a lease last refreshed at ``last_refresh`` can still be alive at ``now``."""
    return now - last_refresh < ttl


class LeaseKeeper:
    """Refreshes a lease from a daemon thread every ``interval`` (default ``ttl / 3``).

    The lease is *lost* when the server says it is gone, or when refreshes keep failing
    (server unreachable) until a whole ``ttl`` has passed since the last successful one,
    after which the server has certainly expired it. On loss the keeper stops, sets
    :attr:`lost`, keeps the cause in :attr:`error` and calls ``on_lost(error)`` once
    from its thread. :meth:`stop` ends the thread without revoking the lease.
    """

    def __init__(
        self,
        lease: Lease,
        *,
        interval: float | None = None,
        on_lost: Callable[[StoreError], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease = lease
        self.interval = lease.ttl / 3.0 if interval is None else interval
        _check_timeout("LeaseKeeper interval", self.interval)
        if self.interval >= lease.ttl:
            raise StoreConfigError(
                f"LeaseKeeper interval ({self.interval:g}s) must be shorter than the lease ttl ({lease.ttl:g}s)"
            )
        self._on_lost = on_lost
        self._clock = clock
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._error: StoreError | None = None
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{lease.id:#x}", daemon=True)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def error(self) -> StoreError | None:
        """Why the lease was lost, once :attr:`lost` is true."""
        return self._error

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def wait_lost(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the lease to be lost; returns :attr:`lost`."""
        return self._lost.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop refreshing and join the thread (a refresh in flight may take ``timeout``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():  # on_lost may stop us
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise StoreTimeoutError(f"stopping the keeper of lease {self.lease.id:#x}", timeout)

    def _run(self) -> None:
        last_refresh = self._clock()
        while not self._stop.wait(self.interval):
            try:
                self.lease.refresh()
            except LeaseExpiredError as e:
                self._lose(e)
                return
            except StoreError as e:
                now = self._clock()
                if not lease_presumed_alive(last_refresh=last_refresh, now=now, ttl=self.lease.ttl):
                    self._lose(
                        LeaseExpiredError(
                            self.lease.id,
                            f"no successful refresh for {now - last_refresh:.1f}s "
                            f"(ttl {self.lease.ttl:g}s); last error: {e}",
                        )
                    )
                    return
                logger.warning("refreshing lease %#x failed, will retry: %s", self.lease.id, e)
            else:
                last_refresh = self._clock()

    def _lose(self, error: StoreError) -> None:
        self._error = error
        self._lost.set()
        logger.warning("lost lease %#x: %s", self.lease.id, error)
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                logger.exception("on_lost callback of lease %#x raised", self.lease.id)

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
