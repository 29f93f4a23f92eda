"""The embedded store's server: a :class:`KeyValueState` served over TCP by one agent.

See :mod:`hyperpodrun.store.embedded` for the backend as a whole and
:mod:`hyperpodrun.store.wire` for the frames and the handshake every connection passes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperpodrun.store.auth import publish_local_secret, unpublish_local_secret
from hyperpodrun.store.base import (
    LeaseExpiredError,
    StoreAddressInUseError,
    StoreClosedError,
    StoreConfigError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    format_endpoint,
)
from hyperpodrun.store.handshake import PREAUTH_FRAME_LIMIT, HandshakeState, ServerHandshake
from hyperpodrun.store.memory import KeyValueState
from hyperpodrun.store.wire import HEADER, arg, b64, encode_frame, recv_frame, send_frame, unb64

__all__ = ["EmbeddedHostNotLocalError", "EmbeddedStoreGoneError", "EmbeddedStoreServer"]

logger = logging.getLogger(__name__)

#: Connections in their handshake at once (no thread, at most a 4 KiB frame each); more are answered
#: ``busy`` and the clients try again.
MAX_PENDING = 256
#: Authenticated connections (a thread each; an agent holds two or three); more are answered ``busy``.
MAX_SESSIONS = 4096
_LISTEN, _WAKE, _PENDING = "listen", "wake", "pending"


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
            # SO_REUSEADDR lets two agents bind the same port until one listens: only the one whose
            # listen() succeeded publishes its secret (clients on this host wait briefly for the file).
            listener.listen(128)
            if self._publish_secret and self._secret:
                self._published = publish_local_secret(self.host, listener.getsockname()[1], self._secret)
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
        """Remove the published secret, unless another agent's has replaced it since."""
        if self._published is not None and self._secret:
            unpublish_local_secret(self._published, self._secret)
        self._published = None

    def __enter__(self) -> EmbeddedStoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- serving

    def _accept_loop(self) -> None:
        """Accept connections and run their handshakes (no thread until a connection proved the secret)."""
        if self._listener is None or self._wake_r is None:
            raise StoreClosedError("the embedded store server is not started")
        pending: dict[socket.socket, ServerHandshake] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ, _LISTEN)
            sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            try:
                while True:
                    timeout = (
                        max(0.0, min(h.deadline for h in pending.values()) - time.monotonic()) if pending else None
                    )
                    for key, _ in sel.select(timeout):
                        if key.data == _WAKE:
                            return
                        if key.data == _LISTEN:
                            self._accept(sel, pending, self._listener)
                        else:
                            self._advance(sel, pending, key.fileobj)  # type: ignore[arg-type]
                    now = time.monotonic()
                    for conn, handshake in list(pending.items()):
                        if now >= handshake.deadline:
                            logger.info("embedded store dropped %s: no handshake within its deadline", handshake.peer)
                            self._forget(sel, pending, conn)
            finally:
                for conn in list(pending):
                    self._forget(sel, pending, conn)

    def _accept(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, ServerHandshake], listener: socket.socket
    ) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("embedded store accept failed: %s", e)
                return
            if len(pending) >= MAX_PENDING:
                _refuse(conn, f"{MAX_PENDING} connections are in their handshake")
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending[conn] = ServerHandshake(secret=self._secret, peer=_peer(conn))
            sel.register(conn, selectors.EVENT_READ, _PENDING)

    def _advance(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, ServerHandshake], conn: socket.socket
    ) -> None:
        handshake = pending[conn]
        try:
            data = conn.recv(PREAUTH_FRAME_LIMIT + HEADER.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._forget(sel, pending, conn)
            return
        for frame in handshake.feed(data):
            try:
                sent = conn.send(frame)
            except OSError:
                sent = 0
            if sent < len(frame):  # a peer that does not read its small answers is not a client
                handshake.state = HandshakeState.FAILED
                break
        if handshake.state is HandshakeState.FAILED or (handshake.state is HandshakeState.DONE and handshake.leftover):
            self._forget(sel, pending, conn)
        elif handshake.state is HandshakeState.DONE:
            sel.unregister(conn)
            del pending[conn]
            self._spawn(conn)

    @staticmethod
    def _forget(
        sel: selectors.BaseSelector, pending: dict[socket.socket, ServerHandshake], conn: socket.socket
    ) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        pending.pop(conn, None)
        conn.close()

    def _spawn(self, conn: socket.socket) -> None:
        """An authenticated connection: a thread of its own, up to :data:`MAX_SESSIONS`."""
        conn.setblocking(True)
        thread = threading.Thread(target=self._serve, args=(conn,), name="embedded-store-conn", daemon=True)
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._threads) >= MAX_SESSIONS:
                _refuse(conn, f"{MAX_SESSIONS} connections are open")
                return
            self._conns.add(conn)
            self._threads.add(thread)
        thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
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


def _refuse(conn: socket.socket, why: str) -> None:
    """Tell a connection the server is at its limit (the client tries again), and close it."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(encode_frame({"error": {"kind": "busy", "message": f"the embedded store is busy: {why}"}}))
    conn.close()


def _peer(conn: socket.socket) -> str:
    try:
        return format_endpoint(*conn.getpeername()[:2])
    except OSError:
        return "a closed connection"
