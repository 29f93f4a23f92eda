"""The embedded store: no external server, hosted by one agent for the whole job.

One agent runs an :class:`EmbeddedStoreServer` in a thread of its own process; every
agent, the host included, talks to it through an :class:`EmbeddedStoreClient`. The wire
format is a 4-byte big-endian length followed by a JSON object (values base64-encoded),
one request and one response per frame, over a small pool of TCP connections per client.
Long waits (:meth:`~EmbeddedStoreClient.wait_for_change`) hold one pooled connection each,
so a lease keeper never queues behind a watcher.

The limit of this backend is the one torchrun's c10d store has: the job cannot outlive the
agent that hosts the store. Use etcd for jobs that must survive any node.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any

from hyperpodrun.security import STORE_SECRET_ENV
from hyperpodrun.store.auth import is_loopback, loopback_name, read_local_secret
from hyperpodrun.store.base import (
    Entry,
    Lease,
    LeaseExpiredError,
    Store,
    StoreAuthError,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    _check_timeout,
    format_endpoint,
    parse_endpoint,
)
from hyperpodrun.store.embedded_server import EmbeddedHostNotLocalError, EmbeddedStoreGoneError, EmbeddedStoreServer
from hyperpodrun.store.memory import KeyValueState
from hyperpodrun.store.wire import (
    PROTOCOL_VERSION,
    ProtocolError,
    b64,
    new_nonce,
    proof,
    proofs_match,
    recv_frame,
    send_frame,
    unb64,
)

__all__ = [
    "DEFAULT_PORT",
    "EmbeddedHostNotLocalError",
    "EmbeddedStoreClient",
    "EmbeddedStoreGoneError",
    "EmbeddedStoreServer",
    "KeyValueState",
]

logger = logging.getLogger(__name__)

#: torchrun's default rendezvous port, used when ``--rdzv-endpoint`` names no port.
DEFAULT_PORT = 29400


# --------------------------------------------------------------------------- client

#: How long a client on the hosting agent's machine waits for the secret file it publishes after listen().
LOCAL_SECRET_WAIT_S = 2.0


class _EmbeddedLease(Lease):
    def __init__(self, client: EmbeddedStoreClient, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._client = client

    def refresh(self) -> None:
        self._client._call({"op": "keepalive", "lease": self._id})

    def revoke(self) -> None:
        self._client._call({"op": "revoke", "lease": self._id})


class _Busy(Exception):
    """Internal: the server is at its connection limit; try again."""


class _Dropped(Exception):
    """Internal: the connection broke; ``sent`` says whether the whole request went out."""

    def __init__(self, sent: bool, cause: BaseException | None) -> None:
        super().__init__(str(cause))
        self.sent, self.cause = sent, cause


#: Requests that may be sent again after a dropped connection even if the first copy
#: reached the server: reads, waits, lease keep-alives, and compare-and-swap (the same
#: expected revision cannot match twice; see :meth:`EmbeddedStoreClient.compare_and_swap`).
_RESENDABLE = frozenset({"get", "get_prefix", "revision", "wait", "keepalive", "cas"})


class EmbeddedStoreClient(Store):
    """A :class:`Store` backed by an :class:`EmbeddedStoreServer` at ``endpoint``.

    The constructor connects, retrying for up to ``connect_timeout`` seconds (the host
    agent may start a little later), and raises :class:`StoreUnavailableError` if nothing
    answers. Every connection proves it knows ``secret`` (for a loopback endpoint without
    one: the secret a local host agent of this user published, if any) and then checks
    that the server proves it too: a client that holds a secret, or that was built with
    ``require_secret`` (every agent's is), never talks to a server that does not prove it,
    so a program that took the port gets no request. A dropped connection is
    replaced once for requests that are safe to resend (see ``_RESENDABLE``, and any
    request that never fully went out); if the server cannot be reached again, requests
    raise :class:`EmbeddedStoreGoneError`. A client given ``server`` owns it and stops it
    on :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        secret: bytes | None = None,
        require_secret: bool = False,
        server: EmbeddedStoreServer | None = None,
    ) -> None:
        _check_timeout("connect_timeout", connect_timeout)
        _check_timeout("request_timeout", request_timeout)
        self._host, self._port = parse_endpoint(endpoint, default_port=DEFAULT_PORT)
        self.endpoint = format_endpoint(self._host, self._port)
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.server = server
        self._secret = secret
        self._require_secret = require_secret
        # only this machine reaches it: a local host agent of this user published its secret
        self._local_only = is_loopback(self._host) or loopback_name(self._host) is not None
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._socks: set[socket.socket] = set()
        self._closed = threading.Event()
        self._release(self._connect_first())

    @property
    def is_host(self) -> bool:
        """Whether this client's process hosts the store (the job ends with it)."""
        return self.server is not None

    # ---- connections

    def _open(self, timeout: float) -> socket.socket:
        """A new connection that has passed the handshake (OSError if it could not); a server at its
        connection limit is asked again until ``timeout`` has passed."""
        deadline = time.monotonic() + timeout
        backoff = 0.05
        while True:
            try:
                return self._open_once(max(deadline - time.monotonic(), 0.01))
            except _Busy as e:
                if time.monotonic() + backoff >= deadline or self._closed.wait(backoff):
                    raise StoreUnavailableError(
                        self.endpoint, f"the embedded store at {self.endpoint} stayed busy for {timeout:g}s: {e}"
                    ) from None
                backoff = min(backoff * 2, 0.5)

    def _open_once(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            closing = self._closed.is_set()
            self._socks.add(sock)
        if closing:  # close() ran before it could see this connection
            self._discard(sock)
            raise StoreClosedError(f"embedded store client for {self.endpoint} is closed")
        try:
            sock.settimeout(min(self.request_timeout, max(timeout, 0.1)))
            self._handshake(sock)
        except OSError as e:
            self._discard(sock)
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(
                f"no handshake: {os.strerror(e.errno).lower() if e.errno else e or type(e).__name__}"
            ) from e
        except BaseException:
            self._discard(sock)
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        """Prove the secret, then check the server's proof; nothing else is sent before both passed."""
        client_nonce = new_nonce()
        send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "nonce": client_nonce})
        reply = recv_frame(sock)
        if reply is None:
            raise ProtocolError("the server closed the connection during the handshake")
        error = reply.get("error")
        if isinstance(error, dict) and error.get("kind") == "busy":
            raise _Busy(str(error.get("message", "busy")))
        hello = reply.get("ok")
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL_VERSION:
            raise StoreError(
                f"{self.endpoint} is not a hyperpodrun embedded store of protocol "
                f"{PROTOCOL_VERSION} (it answered {reply!r:.200})"
            )
        if not hello.get("auth"):
            # A server that asks for no proof is refused if this host holds a secret for its endpoint; a
            # hosting agent publishes its secret only after it listens, so it is read now, not waited for.
            secret = self._secret or (read_local_secret(self._host, self._port) if self._local_only else None)
            if secret is not None or self._require_secret:
                raise StoreAuthError(
                    f"the program listening at {self.endpoint} does not prove it knows this job's secret: it is "
                    "not this job's embedded store (another program, or another user's, holds the port)"
                )
            return
        secret = self._secret or (self._local_secret() if self._local_only else None)
        if secret is None:
            raise StoreAuthError(
                f"the embedded store at {self.endpoint} requires the job's shared secret: "
                f"set --rdzv-conf secret_file=PATH or {STORE_SECRET_ENV} on every node"
            )
        server_nonce = str(hello.get("nonce", ""))
        send_frame(sock, {"op": "auth", "proof": proof(secret, "client", client_nonce, server_nonce)})
        answer = recv_frame(sock)
        granted = answer.get("ok") if answer is not None else None
        if not isinstance(granted, dict):
            raise StoreAuthError(f"the embedded store at {self.endpoint} refused this job's secret (wrong secret?)")
        if not proofs_match(proof(secret, "server", client_nonce, server_nonce), granted.get("proof")):
            raise StoreAuthError(
                f"the program listening at {self.endpoint} does not know this job's secret: "
                "it is not this job's embedded store"
            )

    def _local_secret(self) -> bytes | None:
        """The secret the hosting agent on this host published; it does so just after it starts to listen."""
        deadline = time.monotonic() + LOCAL_SECRET_WAIT_S
        while (secret := read_local_secret(self._host, self._port)) is None and time.monotonic() < deadline:
            if self._closed.wait(0.02):
                break
        return secret

    def _connect_first(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout
        backoff = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                return self._open(max(remaining, 0.01))
            except ProtocolError as e:  # something answered, but not as an embedded store
                raise StoreUnavailableError(
                    self.endpoint, f"{self.endpoint} does not answer as an embedded store: {e}"
                ) from e
            except OSError as e:
                reason = os.strerror(e.errno) if e.errno else (str(e) or type(e).__name__)
                if remaining <= 0 or self._closed.wait(min(backoff, remaining)):
                    raise StoreUnavailableError(
                        self.endpoint,
                        f"embedded store at {self.endpoint} is unreachable after "
                        f"{self.connect_timeout:g}s: {reason.lower()} (is the hosting agent running?)",
                    ) from e
                backoff = min(backoff * 2, 0.5)

    def _acquire(self, *, fresh: bool = False) -> socket.socket:
        with self._lock:
            if self._closed.is_set():
                raise StoreClosedError(f"embedded store client for {self.endpoint} is closed")
            if self._idle and not fresh:
                return self._idle.pop()
        try:
            return self._open(self.request_timeout)
        except StoreError:
            raise
        except OSError as e:
            raise EmbeddedStoreGoneError(self.endpoint) from e

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed.is_set():
                self._idle.append(sock)
                return
        self._discard(sock)

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def _exchange(self, request: dict[str, Any], *, wait: float, fresh: bool) -> dict[str, Any]:
        sock = self._acquire(fresh=fresh)
        timeout = self.request_timeout + wait
        sent = False
        try:
            sock.settimeout(timeout)
            send_frame(sock, request)
            sent = True
            response = recv_frame(sock)
        except TimeoutError as e:
            self._discard(sock)
            raise StoreTimeoutError(f"{request['op']} request to the embedded store at {self.endpoint}", timeout) from e
        except OSError as e:
            self._discard(sock)
            raise _Dropped(sent, e) from e
        if response is None:
            self._discard(sock)
            raise _Dropped(True, None)
        self._release(sock)
        return response

    def _call_resent(self, request: dict[str, Any], *, wait: float = 0.0) -> tuple[Any, bool]:
        """The request's result, and whether it had to be sent a second time."""
        resent = False
        while True:
            try:
                response = self._exchange(request, wait=wait, fresh=resent)
                break
            except _Dropped as e:
                if self._closed.is_set():
                    raise StoreClosedError(f"embedded store client for {self.endpoint} is closed") from e.cause
                if resent or (e.sent and request["op"] not in _RESENDABLE):
                    raise EmbeddedStoreGoneError(self.endpoint) from e.cause
                logger.info(
                    "embedded store connection to %s dropped during %s; resending", self.endpoint, request["op"]
                )
                resent = True
        if "error" in response:
            error = response["error"]
            if error.get("kind") == "lease_expired":
                raise LeaseExpiredError(int(error.get("lease", 0)))
            raise StoreError(f"embedded store at {self.endpoint} rejected {request['op']}: {error.get('message')}")
        return response.get("ok"), resent

    def _call(self, request: dict[str, Any], *, wait: float = 0.0) -> Any:
        return self._call_resent(request, wait=wait)[0]

    # ---- Store

    def get(self, key: str) -> Entry | None:
        result = self._call({"op": "get", "key": key})
        return None if result is None else Entry(unb64(result[0]), int(result[1]))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        result = self._call({"op": "get_prefix", "prefix": prefix})
        return {k: Entry(unb64(v), int(rev)) for k, v, rev in result}

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        return int(self._call({"op": "put", "key": key, "value": b64(value), "lease": _lease_id(lease)}))

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        if expected_revision < 0:
            raise ValueError(f"expected_revision must be >= 0, got {expected_revision}")
        request = {
            "op": "cas",
            "key": key,
            "value": b64(value),
            "expected": expected_revision,
            "lease": _lease_id(lease),
        }
        swapped, resent = self._call_resent(request)
        if swapped or not resent:
            return bool(swapped)
        # Resent after a dropped connection: the first copy may have been the one applied.
        entry = self.get(key)
        return entry is not None and entry.value == value and entry.revision > expected_revision

    def delete(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key}))

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call({"op": "delete_prefix", "prefix": prefix}))

    def grant_lease(self, ttl: float) -> Lease:
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"lease ttl must be a finite number > 0, got {ttl!r}")
        lease_id, granted = self._call({"op": "grant", "ttl": float(ttl)})
        return _EmbeddedLease(self, int(lease_id), float(granted))

    def current_revision(self) -> int:
        return int(self._call({"op": "revision"}))

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        request = {"op": "wait", "prefix": prefix, "after": after_revision, "timeout": float(timeout)}
        result = self._call(request, wait=timeout)
        return None if result is None else int(result)

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            socks = list(self._socks)
            self._idle.clear()
        for sock in socks:  # also cuts short waits in flight on other threads
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._discard(sock)
        if self.server is not None:
            self.server.close()

    def __repr__(self) -> str:
        role = "host" if self.is_host else "client"
        return f"EmbeddedStoreClient({self.endpoint!r}, {role})"


def _lease_id(lease: Lease | None) -> int:
    return 0 if lease is None else lease.id
