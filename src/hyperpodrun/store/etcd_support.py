"""Pieces of the etcd backend that are not the store itself: its configuration, the
gateway's error codes and JSON encoding, retry pacing, and the watch stream's reader."""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import os
import random
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any, Literal

import requests
import urllib3.exceptions

from hyperpodrun.store.base import StoreConfigError, StoreError, _check_timeout, parse_endpoint

DEFAULT_PORT = 2379
MIN_ATTEMPT_TIMEOUT = 0.05

# gRPC status codes that etcd's gateway reports in its JSON error bodies.
INVALID_ARGUMENT = 3
NOT_FOUND = 5
PERMISSION_DENIED = 7
UNAVAILABLE = 14
UNAUTHENTICATED = 16

# UNAVAILABLE answers that etcd gives before a write is proposed, so it was not applied.
# (Its timeouts, e.g. "request timed out", are UNAVAILABLE too but may have been applied.)
NOT_APPLIED = ("no leader", "leader changed", "too many requests", "not enough started members")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """How to reach etcd. Field names match the ``--rdzv-conf`` keys they come from.

    ``protocol`` defaults to ``https`` when ``cacert`` or ``cert`` is given, else ``http``.
    ``connect_timeout`` bounds how long one call keeps trying the endpoints in turn;
    ``request_timeout`` bounds the wait for an answer once a request was sent.
    """

    endpoints: tuple[str, ...]
    protocol: Literal["http", "https"] | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    connect_timeout: float = 5.0
    request_timeout: float = 10.0
    api_path: str = "/v3/"
    insecure: bool = False
    """Allow a password over plain http (anyone on the path can read it)."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str) or not self.endpoints:
            raise StoreConfigError("endpoints must be a non-empty tuple of 'host:port' strings")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint, default_port=DEFAULT_PORT)
        if self.protocol not in (None, "http", "https"):
            raise StoreConfigError(f"protocol must be 'http' or 'https', got {self.protocol!r}")
        if self.protocol == "http" and (self.cacert or self.cert):
            raise StoreConfigError("protocol 'http' contradicts cacert/cert, which need https")
        if (self.cert is None) != (self.key is None):
            missing = "key" if self.key is None else "cert"
            raise StoreConfigError(f"{missing} is required when {'cert' if missing == 'key' else 'key'} is given")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise StoreConfigError(f"{name}: file {path!r} does not exist")
        _check_tls_files(self.cacert, self.cert, self.key)
        if (self.user is None) != (self.password is None):
            missing = "password" if self.password is None else "user"
            raise StoreConfigError(
                f"{missing} is required when {'user' if missing == 'password' else 'password'} is given"
            )
        if self.user == "":
            raise StoreConfigError("user must be non-empty")
        if self.password is not None and self.scheme == "http" and not self.insecure:
            raise StoreConfigError(
                "--rdzv-conf password: refusing to send the etcd password over plain http; "
                "use TLS (cacert=... or protocol=https) or accept the risk with insecure=true"
            )
        _check_timeout("connect_timeout", self.connect_timeout)
        _check_timeout("request_timeout", self.request_timeout)
        if not (self.api_path.startswith("/") and self.api_path.endswith("/")):
            raise StoreConfigError(f"api_path must start and end with '/', got {self.api_path!r}")

    @property
    def scheme(self) -> str:
        if self.protocol is not None:
            return self.protocol
        return "https" if (self.cacert or self.cert) else "http"


def _check_tls_files(cacert: str | None, cert: str | None, key: str | None) -> None:
    """Load the TLS files once now, so a wrong file is named before any connection."""
    context = ssl.create_default_context()
    try:
        if cacert is not None:
            context.load_verify_locations(cafile=cacert)
    except (ssl.SSLError, ValueError) as e:
        raise StoreConfigError(f"cacert: {cacert!r} is not a PEM CA certificate file ({e})") from None
    try:
        if cert is not None:
            context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as e:
        raise StoreConfigError(
            f"cert/key: {cert!r} and {key!r} are not a matching PEM certificate and key ({e})"
        ) from None


class EtcdApiError(StoreError):
    """etcd answered a request with an error status."""

    def __init__(self, endpoint: str, what: str, status: int, code: int | None, message: str) -> None:
        super().__init__(f"etcd at {endpoint} failed {what}: {message} (HTTP {status})")
        self.status = status
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class Broken:
    """A watch stream ended without an answer (it is opened again)."""

    reason: str


class Backoff:
    """Jittered exponential delays: 50 ms doubling to 1 s, each drawn from [d/2, d]."""

    def __init__(self, first: float = 0.05, cap: float = 1.0) -> None:
        self._delay, self._cap = first, cap

    def next(self) -> float:
        delay = random.uniform(self._delay / 2, self._delay)
        self._delay = min(self._delay * 2, self._cap)
        return delay


class Retry(Exception):
    """Internal: this attempt failed in a way that is safe to retry on another endpoint."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def key_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) that covers every key starting with ``prefix``."""
    start = prefix.encode()
    end = bytearray(start)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return start, bytes(end)
        end.pop()
    return (start or b"\0"), b"\0"  # no upper bound: to the end of the keyspace


def os_reason(exc: BaseException) -> str:
    """A short reason ("connection refused") from a requests/urllib3 exception chain."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, http.client.RemoteDisconnected):
            return "the server closed the connection without an answer"
        if isinstance(e, OSError) and e.strerror:
            return e.strerror if isinstance(e, ssl.SSLError) else e.strerror.lower()
        if isinstance(e, (requests.ConnectTimeout, urllib3.exceptions.ConnectTimeoutError)) and not isinstance(
            e, urllib3.exceptions.NewConnectionError
        ):
            return "connection timed out"
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None)])
        todo.extend(a for a in e.args if isinstance(a, BaseException))
    return str(exc)


def never_sent(exc: requests.ConnectionError) -> bool:
    """Whether the request failed before reaching the server (safe to resend anywhere)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, urllib3.exceptions.ConnectTimeoutError)  # includes NewConnectionError


def stream_socket(response: requests.Response) -> socket.socket | None:
    """The socket under a streamed response (urllib3 exposes it as ``raw.connection.sock``)."""
    return getattr(getattr(response.raw, "connection", None), "sock", None)


def json_lines(response: requests.Response, sock: socket.socket | None, *, deadline: float) -> Iterator[dict[str, Any]]:
    """The newline-delimited JSON messages of a gateway stream, read until ``deadline``.

    Each read of ``sock`` is given the time left, so a quiet stream raises urllib3's
    ``ReadTimeoutError`` (wrapped in ``requests.ConnectionError``) at the deadline.
    Without the socket, reads are bounded by the request timeout instead.
    """
    chunks = response.iter_content(chunk_size=None)
    buffer = b""
    while True:
        if sock is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = next(chunks, None)
        if chunk is None:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
