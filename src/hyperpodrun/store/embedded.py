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

import base64
import errno
import json
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hyperpodrun.store.memory import KeyValueState
from hyperpodrun.store.base import (
    Entry,
    Lease,
    LeaseExpiredError,
    Store,
    StoreAddressInUseError,
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
PROTOCOL_VERSION = 1
_MAX_FRAME = 64 * 1024 * 1024
_HEADER = struct.Struct("!I")


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


# --------------------------------------------------------------------------- wire format


class _ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


def _send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > _MAX_FRAME:
        raise StoreError(f"embedded store message of {len(data)} bytes exceeds {_MAX_FRAME} bytes")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise _ProtocolError("connection closed in the middle of a frame")
            return None
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or ``None`` if the peer closed the connection between frames."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > _MAX_FRAME:
        raise _ProtocolError(f"frame of {length} bytes exceeds {_MAX_FRAME} bytes")
    body = _recv_exact(sock, length)
    if body is None:
        raise _ProtocolError("connection closed after a frame header")
    try:
        message = json.loads(body)
    except ValueError as e:
        raise _ProtocolError(f"frame is not JSON: {e}") from e
    if not isinstance(message, dict):
        raise _ProtocolError("frame is not a JSON object")
    return message


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _arg(request: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = request.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"request field {name!r} is missing or of the wrong type")
    return value


# --------------------------------------------------------------------------- server


class EmbeddedStoreServer:
    """Serves a :class:`KeyValueState` over TCP from threads of the calling process.

    Binds exactly ``host`` (loopback by default), never a wider address; ``port=0`` picks
    a free port (see :attr:`endpoint`). :meth:`start` raises
    :class:`~hyperpodrun.store.base.StoreAddressInUseError` when the address is taken,
    typically by another agent hosting the store, so the caller can become a client.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not host:
            raise StoreConfigError("EmbeddedStoreServer host must be non-empty")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise StoreConfigError(f"EmbeddedStoreServer port must be in [0, 65535], got {port!r}")
        self.host = host
        self.port = port
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
            "hello": lambda r: {"protocol": PROTOCOL_VERSION},
            "revision": lambda r: self._state.revision(),
            "get": self._op_get,
            "get_prefix": self._op_get_prefix,
            "put": lambda r: self._state.put(
                _arg(r, "key", str), _unb64(_arg(r, "value", str)), lease_id=_arg(r, "lease", int)
            ),
            "cas": lambda r: self._state.compare_and_swap(
                _arg(r, "key", str),
                _unb64(_arg(r, "value", str)),
                expected_revision=_arg(r, "expected", int),
                lease_id=_arg(r, "lease", int),
            ),
            "delete": lambda r: self._state.delete(_arg(r, "key", str)),
            "delete_prefix": lambda r: self._state.delete_prefix(_arg(r, "prefix", str)),
            "grant": self._op_grant,
            "keepalive": lambda r: self._state.refresh_lease(_arg(r, "lease", int)),
            "revoke": lambda r: self._state.revoke_lease(_arg(r, "lease", int)),
            "wait": lambda r: self._state.wait_for_change(
                _arg(r, "prefix", str),
                after_revision=_arg(r, "after", int),
                timeout=float(_arg(r, "timeout", (int, float))),
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
            listener.listen(128)
            listener.setblocking(False)
        except OSError as e:
            listener.close()
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
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck or (self._accept_thread is not None and self._accept_thread.is_alive()):
            raise StoreTimeoutError(f"stopping the embedded store threads {stuck}", timeout)

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

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                request = _recv_frame(conn)
                if request is None:
                    return
                response = self._dispatch(request)
                if response is None:
                    return
                _send_frame(conn, response)
        except OSError as e:  # includes _ProtocolError: drop the connection
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
        entry = self._state.get(_arg(request, "key", str))
        return None if entry is None else [_b64(entry.value), entry.revision]

    def _op_get_prefix(self, request: dict[str, Any]) -> list[list[Any]]:
        entries = self._state.get_prefix(_arg(request, "prefix", str))
        return [[k, _b64(e.value), e.revision] for k, e in entries.items()]

    def _op_grant(self, request: dict[str, Any]) -> list[Any]:
        lease_id, ttl = self._state.grant_lease(float(_arg(request, "ttl", (int, float))))
        return [lease_id, ttl]


# --------------------------------------------------------------------------- client


class _EmbeddedLease(Lease):
    def __init__(self, client: EmbeddedStoreClient, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._client = client

    def refresh(self) -> None:
        self._client._call({"op": "keepalive", "lease": self._id})

    def revoke(self) -> None:
        self._client._call({"op": "revoke", "lease": self._id})


class EmbeddedStoreClient(Store):
    """A :class:`Store` backed by an :class:`EmbeddedStoreServer` at ``endpoint``.

    The constructor connects, retrying for up to ``connect_timeout`` seconds (the host
    agent may start a little later), and raises :class:`StoreUnavailableError` if nothing
    answers. Once connected, losing the server raises :class:`EmbeddedStoreGoneError`.
    A client given ``server`` owns it and stops it on :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        server: EmbeddedStoreServer | None = None,
    ) -> None:
        _check_timeout("connect_timeout", connect_timeout)
        _check_timeout("request_timeout", request_timeout)
        self._host, self._port = parse_endpoint(endpoint, default_port=DEFAULT_PORT)
        self.endpoint = format_endpoint(self._host, self._port)
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.server = server
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
        sock = socket.create_connection((self._host, self._port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            closing = self._closed.is_set()
            self._socks.add(sock)
        if closing:  # close() ran before it could see this connection
            self._discard(sock)
            raise StoreClosedError(f"embedded store client for {self.endpoint} is closed")
        return sock

    def _connect_first(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout
        backoff = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = self._open(max(remaining, 0.01))
            except OSError as e:
                reason = os.strerror(e.errno) if e.errno else (str(e) or type(e).__name__)
                if remaining <= 0 or self._closed.wait(min(backoff, remaining)):
                    raise StoreUnavailableError(
                        self.endpoint,
                        f"embedded store at {self.endpoint} is unreachable after "
                        f"{self.connect_timeout:g}s: {reason.lower()} (is the hosting agent running?)",
                    ) from e
                backoff = min(backoff * 2, 0.5)
                continue
            try:  # the handshake shares the connect deadline
                sock.settimeout(min(self.request_timeout, max(deadline - time.monotonic(), 0.1)))
                _send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION})
                reply = _recv_frame(sock)
            except OSError as e:
                self._discard(sock)
                raise StoreUnavailableError(
                    self.endpoint, f"{self.endpoint} does not answer as an embedded store: {e}"
                ) from e
            if not reply or reply.get("ok", {}).get("protocol") != PROTOCOL_VERSION:
                self._discard(sock)
                raise StoreError(
                    f"{self.endpoint} is not a hyperpodrun embedded store of protocol "
                    f"{PROTOCOL_VERSION} (it answered {reply!r:.200})"
                )
            return sock

    def _acquire(self) -> socket.socket:
        with self._lock:
            if self._closed.is_set():
                raise StoreClosedError(f"embedded store client for {self.endpoint} is closed")
            if self._idle:
                return self._idle.pop()
        try:
            return self._open(self.request_timeout)
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

    def _call(self, request: dict[str, Any], *, wait: float = 0.0) -> Any:
        sock = self._acquire()
        timeout = self.request_timeout + wait
        try:
            sock.settimeout(timeout)
            _send_frame(sock, request)
            response = _recv_frame(sock)
        except TimeoutError as e:
            self._discard(sock)
            raise StoreTimeoutError(f"{request['op']} request to the embedded store at {self.endpoint}", timeout) from e
        except OSError as e:
            self._discard(sock)
            if self._closed.is_set():
                raise StoreClosedError(f"embedded store client for {self.endpoint} is closed") from e
            raise EmbeddedStoreGoneError(self.endpoint) from e
        if response is None:
            self._discard(sock)
            if self._closed.is_set():
                raise StoreClosedError(f"embedded store client for {self.endpoint} is closed")
            raise EmbeddedStoreGoneError(self.endpoint)
        self._release(sock)
        if "error" in response:
            error = response["error"]
            if error.get("kind") == "lease_expired":
                raise LeaseExpiredError(int(error.get("lease", 0)))
            raise StoreError(f"embedded store at {self.endpoint} rejected {request['op']}: {error.get('message')}")
        return response.get("ok")

    # ---- Store

    def get(self, key: str) -> Entry | None:
        result = self._call({"op": "get", "key": key})
        return None if result is None else Entry(_unb64(result[0]), int(result[1]))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        result = self._call({"op": "get_prefix", "prefix": prefix})
        return {k: Entry(_unb64(v), int(rev)) for k, v, rev in result}

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        return int(self._call({"op": "put", "key": key, "value": _b64(value), "lease": _lease_id(lease)}))

    def compare_and_swap(
        self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None
    ) -> bool:
        if expected_revision < 0:
            raise ValueError(f"expected_revision must be >= 0, got {expected_revision}")
        request = {
            "op": "cas",
            "key": key,
            "value": _b64(value),
            "expected": expected_revision,
            "lease": _lease_id(lease),
        }
        return bool(self._call(request))

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
