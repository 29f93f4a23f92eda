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

import errno
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperpodrun.security import STORE_SECRET_ENV
from hyperpodrun.store.auth import is_loopback, publish_local_secret, read_local_secret
from hyperpodrun.store.memory import KeyValueState
from hyperpodrun.store.wire import (
    PROTOCOL_VERSION,
    arg,
    b64,
    ProtocolError,
    recv_frame,
    send_frame,
    unb64,
    new_nonce,
    proof,
    proofs_match,
)
from hyperpodrun.store.base import (
    Entry,
    Lease,
    LeaseExpiredError,
    Store,
    StoreAddressInUseError,
    StoreAuthError,
    StoreClosedError,
    StoreConfigError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    _check_timeout,
    format_endpoint,
    parse_endpoint,
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
_HANDSHAKE_TIMEOUT = 10.0


class EmbeddedHostNotLocalError(StoreConfigError):
    """The address to host the store on is not one of this machine's (another node hosts it)."""


class EmbeddedStoreGoneError(StoreUnavailableError):
    """The agent hosting the embedded store exited, taking the store with it."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(
            endpoint,
            f"embedded store hosted at {endpoint} is gone (the agent that hosted it "
            "exited); the job cannot outlive its host agent — use --rdzv-backend etcd for that",
        )


# --------------------------------------------------------------------------- server


class EmbeddedStoreServer:
    """Serves a :class:`KeyValueState` over TCP from threads of the calling process.

    Binds exactly ``host`` (loopback by default), never a wider address; ``port=0`` picks
    a free port (see :attr:`endpoint`). :meth:`start` raises
    :class:`~hyperpodrun.store.base.StoreAddressInUseError` when the address is taken,
    typically by another agent hosting the store, so the caller can become a client.

    With a ``secret``, every connection must prove it knows it before any other request
    (see :mod:`hyperpodrun.store.wire`); ``publish_secret`` also writes it where this
    user's other agents on this host find it (:mod:`hyperpodrun.store.auth`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        publish_secret: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not host:
            raise StoreConfigError("EmbeddedStoreServer host must be non-empty")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise StoreConfigError(f"EmbeddedStoreServer port must be in [0, 65535], got {port!r}")
        if publish_secret and not secret:
            raise StoreConfigError("EmbeddedStoreServer publish_secret needs a secret")
        self.host = host
        self.port = port
        self._secret = secret
        self._publish_secret = publish_secret
        self._published: Path | None = None
        self._state = KeyValueState(clock=clock)
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None  # wakes the accept loop on close()
        self._wake_w: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self._closed = False
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "revision": lambda r: self._state.revision(),
            "get": self._op_get,
            "get_prefix": self._op_get_prefix,
            "put": lambda r: self._state.put(
                arg(r, "key", str), unb64(arg(r, "value", str)), lease_id=arg(r, "lease", int)
            ),
            "cas": lambda r: self._state.compare_and_swap(
                arg(r, "key", str),
                unb64(arg(r, "value", str)),
                expected_revision=arg(r, "expected", int),
                lease_id=arg(r, "lease", int),
            ),
            "delete": lambda r: self._state.delete(arg(r, "key", str)),
            "delete_prefix": lambda r: self._state.delete_prefix(arg(r, "prefix", str)),
            "grant": self._op_grant,
            "keepalive": lambda r: self._state.refresh_lease(arg(r, "lease", int)),
            "revoke": lambda r: self._state.revoke_lease(arg(r, "lease", int)),
            "wait": lambda r: self._state.wait_for_change(
                arg(r, "prefix", str),
                after_revision=arg(r, "after", int),
                timeout=float(arg(r, "timeout", (int, float))),
            ),
        }

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); only valid after :meth:`start`."""
        if self._listener is None:
            raise StoreError("the embedded store server has not been started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def endpoint(self) -> str:
        return format_endpoint(*self.address)

    @property
    def secret(self) -> bytes | None:
        """The secret every connection must prove (its host agent's own clients use it)."""
        return self._secret

    def start(self) -> EmbeddedStoreServer:
        if self._listener is not None or self._closed:
            raise StoreError("an EmbeddedStoreServer can be started only once")
        wanted = format_endpoint(self.host, self.port)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as e:
            raise StoreConfigError(f"cannot host the embedded store at {wanted}: {e}") from e
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            if self._publish_secret and self._secret:  # before anyone can connect
                self._published = publish_local_secret(self.host, listener.getsockname()[1], self._secret)
            listener.listen(128)
            listener.setblocking(False)
        except OSError as e:
            listener.close()
            self._unpublish()
            if e.errno == errno.EADDRINUSE:
                raise StoreAddressInUseError(wanted) from e
            if e.errno == errno.EADDRNOTAVAIL:
                raise EmbeddedHostNotLocalError(
                    f"cannot host the embedded store at {wanted}: not an address of this machine"
                ) from e
            raise StoreConfigError(f"cannot host the embedded store at {wanted}: {e.strerror or e}") from e
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"embedded-store-{self.endpoint}", daemon=True
        )
        self._accept_thread.start()
        logger.info("embedded store listening on %s", self.endpoint)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: waits are cut short and every client connection is closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)
        self._state.close()
        if self._wake_w is not None:
            self._wake_w.send(b"x")
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._unpublish()
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck or (self._accept_thread is not None and self._accept_thread.is_alive()):
            raise StoreTimeoutError(f"stopping the embedded store threads {stuck}", timeout)

    def _unpublish(self) -> None:
        if self._published is not None:
            self._published.unlink(missing_ok=True)
            self._published = None

    def __enter__(self) -> EmbeddedStoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- serving

    def _accept_loop(self) -> None:
        if self._listener is None or self._wake_r is None:
            raise StoreClosedError("the embedded store server is not started")
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, _ = self._listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        logger.warning("embedded store accept failed: %s", e)
                        continue
                    self._spawn(conn)

    def _spawn(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve, args=(conn,), name="embedded-store-conn", daemon=True)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
            self._threads.add(thread)
        thread.start()

    def _handshake(self, conn: socket.socket) -> bool:
        """Answer ``hello`` and, with a secret, check the client's proof; False drops it."""
        hello = recv_frame(conn)
        if hello is None:
            return False
        if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL_VERSION:
            send_frame(conn, {"error": {"kind": "protocol", "message": f"expected hello of protocol {PROTOCOL_VERSION}"}})
            return False
        if self._secret is None:
            send_frame(conn, {"ok": {"protocol": PROTOCOL_VERSION, "auth": False}})
            return True
        client_nonce, server_nonce = str(hello.get("nonce", "")), new_nonce()
        mine = proof(self._secret, "server", client_nonce, server_nonce)
        send_frame(conn, {"ok": {"protocol": PROTOCOL_VERSION, "auth": True, "nonce": server_nonce, "proof": mine}})
        answer = recv_frame(conn)
        expected = proof(self._secret, "client", client_nonce, server_nonce)
        if answer is None or answer.get("op") != "auth" or not proofs_match(expected, answer.get("proof")):
            logger.warning("embedded store refused a connection from %s: wrong or no secret", _peer(conn))
            send_frame(conn, {"error": {"kind": "auth", "message": "wrong store secret"}})
            return False
        send_frame(conn, {"ok": True})
        return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT)  # a silent peer must not hold a thread
            if not self._handshake(conn):
                return
            conn.settimeout(None)
            while True:
                request = recv_frame(conn)
                if request is None:
                    return
                response = self._dispatch(request)
                if response is None:
                    return
                send_frame(conn, response)
        except OSError as e:  # includes ProtocolError: drop the connection
            if not self._closed:
                logger.debug("embedded store connection dropped: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _dispatch(self, request: dict[str, Any]) -> dict[str, Any] | None:
        handler = self._handlers.get(request.get("op"))  # type: ignore[arg-type]
        if handler is None:
            return {"error": {"kind": "bad_request", "message": f"unknown op {request.get('op')!r}"}}
        try:
            return {"ok": handler(request)}
        except StoreClosedError:
            return None
        except LeaseExpiredError as e:
            return {"error": {"kind": "lease_expired", "lease": e.lease_id, "message": str(e)}}
        except (ValueError, TypeError) as e:
            return {"error": {"kind": "bad_request", "message": str(e)}}

    def _op_get(self, request: dict[str, Any]) -> list[Any] | None:
        entry = self._state.get(arg(request, "key", str))
        return None if entry is None else [b64(entry.value), entry.revision]

    def _op_get_prefix(self, request: dict[str, Any]) -> list[list[Any]]:
        entries = self._state.get_prefix(arg(request, "prefix", str))
        return [[k, b64(e.value), e.revision] for k, e in entries.items()]

    def _op_grant(self, request: dict[str, Any]) -> list[Any]:
        lease_id, ttl = self._state.grant_lease(float(arg(request, "ttl", (int, float))))
        return [lease_id, ttl]


def _peer(conn: socket.socket) -> str:
    try:
        return format_endpoint(*conn.getpeername()[:2])
    except OSError:
        return "a closed connection"


# --------------------------------------------------------------------------- client


class _EmbeddedLease(Lease):
    def __init__(self, client: EmbeddedStoreClient, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._client = client

    def refresh(self) -> None:
        self._client._call({"op": "keepalive", "lease": self._id})

    def revoke(self) -> None:
        self._client._call({"op": "revoke", "lease": self._id})


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
    one: the secret a local host agent published, if any). A dropped connection is
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
        """A new connection that has passed the handshake (OSError if it could not)."""
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
            raise ProtocolError(f"no handshake: {os.strerror(e.errno).lower() if e.errno else e or type(e).__name__}") from e
        except BaseException:
            self._discard(sock)
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        client_nonce = new_nonce()
        send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "nonce": client_nonce})
        reply = recv_frame(sock)
        if reply is None:
            raise ProtocolError("the server closed the connection during the handshake")
        hello = reply.get("ok")
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL_VERSION:
            raise StoreError(
                f"{self.endpoint} is not a hyperpodrun embedded store of protocol "
                f"{PROTOCOL_VERSION} (it answered {reply!r:.200})"
            )
        if not hello.get("auth"):
            return
        secret = self._secret or (read_local_secret(self._host, self._port) if is_loopback(self._host) else None)
        if secret is None:
            raise StoreAuthError(
                f"the embedded store at {self.endpoint} requires the job's shared secret: "
                f"set --rdzv-conf secret_file=PATH or {STORE_SECRET_ENV} on every node"
            )
        server_nonce = str(hello.get("nonce", ""))
        if not proofs_match(proof(secret, "server", client_nonce, server_nonce), hello.get("proof")):
            raise StoreAuthError(f"the embedded store at {self.endpoint} does not know this job's secret (wrong secret?)")
        send_frame(sock, {"op": "auth", "proof": proof(secret, "client", client_nonce, server_nonce)})
        if (answer := recv_frame(sock)) is None or answer.get("ok") is not True:
            raise StoreAuthError(f"the embedded store at {self.endpoint} refused this job's secret (wrong secret?)")

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
                logger.info("embedded store connection to %s dropped during %s; resending", self.endpoint, request["op"])
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

    def compare_and_swap(
        self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None
    ) -> bool:
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
