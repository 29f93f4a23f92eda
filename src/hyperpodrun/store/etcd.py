"""The etcd v3 backend, through etcd's HTTP/JSON gateway and the ``etcd3gw`` client.

``etcd3gw`` supplies the endpoint objects (HTTP session, TLS settings, URL layout of the
gateway, whose path for etcd >= 3.4 is ``/v3/``). Requests are sent by this module's small
transport rather than ``Etcd3Client.post``/``watch`` because fail-over has to know whether
a failed request can have reached the server (only then is a write unsafe to resend),
every attempt needs a connect timeout bounded by the caller's deadline, user/password
authentication needs a token header (``etcd3gw`` has no auth), and change waits need a
watch stream whose reads are bounded by the wait's timeout.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import json
import logging
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import etcd3gw
import requests
import urllib3.exceptions

from hyperpodrun.store.base import (
    KEY_ROOT,
    Entry,
    Lease,
    LeaseExpiredError,
    Store,
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

__all__ = ["DEFAULT_PORT", "EtcdConfig", "EtcdStore"]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
_MIN_ATTEMPT_TIMEOUT = 0.05

# gRPC status codes that etcd's gateway reports in its JSON error bodies.
_INVALID_ARGUMENT = 3
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16


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
        if (self.user is None) != (self.password is None):
            missing = "password" if self.password is None else "user"
            raise StoreConfigError(f"{missing} is required when {'user' if missing == 'password' else 'password'} is given")
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


class _EtcdApiError(StoreError):
    """etcd answered a request with an error status."""

    def __init__(self, endpoint: str, what: str, status: int, code: int | None, message: str) -> None:
        super().__init__(f"etcd at {endpoint} failed {what}: {message} (HTTP {status})")
        self.status = status
        self.code = code
        self.message = message


class _Retry(Exception):
    """Internal: this attempt failed in a way that is safe to retry on another endpoint."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _key_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) that covers every key starting with ``prefix``."""
    start = prefix.encode()
    end = bytearray(start)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return start, bytes(end)
        end.pop()
    return (start or b"\0"), b"\0"  # no upper bound: to the end of the keyspace


def _os_reason(exc: BaseException) -> str:
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


def _never_sent(exc: requests.ConnectionError) -> bool:
    """Whether the request failed before reaching the server (safe to resend anywhere)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, urllib3.exceptions.ConnectTimeoutError)  # includes NewConnectionError


class _EtcdLease(Lease):
    def __init__(self, store: EtcdStore, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._store = store

    def refresh(self) -> None:
        result = self._store._post("lease/keepalive", {"ID": self._id}, idempotent=True).get("result", {})
        if int(result.get("TTL", 0)) <= 0:
            raise LeaseExpiredError(self._id)

    def revoke(self) -> None:
        try:
            self._store._post("lease/revoke", {"ID": self._id}, idempotent=True)
        except _EtcdApiError as e:
            if e.code != _NOT_FOUND:
                raise


class EtcdStore(Store):
    """A :class:`Store` on an etcd v3 cluster, failing over between its endpoints.

    The constructor authenticates (when ``user`` is set) and checks that etcd answers, so a
    wrong endpoint or credential fails here, within ``connect_timeout``.
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self._session = requests.Session()
        # Passed with every request: a session-level ``verify`` would lose to the
        # REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE environment variables.
        self._verify: str | bool = config.cacert if config.cacert is not None else True
        self._cert = (config.cert, config.key) if config.cert is not None and config.key is not None else None
        self._endpoints: list[tuple[str, etcd3gw.Etcd3Client]] = []
        for endpoint in config.endpoints:
            host, port = parse_endpoint(endpoint, default_port=DEFAULT_PORT)
            client = etcd3gw.Etcd3Client(
                host=host, port=port, protocol=config.scheme, api_path=config.api_path, session=self._session
            )
            self._endpoints.append((format_endpoint(host, port), client))
        self._names = ",".join(name for name, _ in self._endpoints)
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self._closed = threading.Event()
        self._watches: set[socket.socket | None] = set()
        try:
            if config.user is not None:
                self._authenticate()
                self.current_revision()
            else:
                # A key read, unlike a status call, fails when etcd requires credentials.
                self._post("kv/range", {"key": _b64(KEY_ROOT.encode()), "count_only": True}, idempotent=True)
        except BaseException:
            self._session.close()
            raise

    # ---- transport

    def _headers(self) -> dict[str, str]:
        with self._lock:
            return {"Authorization": self._token} if self._token else {}

    def _authenticate(self) -> None:
        if self.config.user is None or self.config.password is None:
            raise StoreConfigError("etcd authentication needs both user and password in --rdzv-conf")
        try:
            reply = self._post(
                "auth/authenticate",
                {"name": self.config.user, "password": self.config.password},
                idempotent=True,
                authenticated=False,
            )
        except _EtcdApiError as e:
            raise StoreAuthError(f"etcd at {self._names} rejected user {self.config.user!r}: {e.message}") from e
        with self._lock:
            self._token = reply.get("token") or None

    def _post(
        self, path: str, payload: dict[str, Any], *, idempotent: bool, authenticated: bool = True
    ) -> dict[str, Any]:
        response = self._send(path, payload, idempotent=idempotent, authenticated=authenticated)
        try:
            return response.json()
        finally:
            response.close()

    def _send(
        self,
        path: str,
        payload: dict[str, Any],
        *,
        idempotent: bool,
        authenticated: bool = True,
        stream: bool = False,
        read_timeout: float | None = None,
    ) -> requests.Response:
        """POST to the first endpoint that answers, trying each in turn until the deadline."""
        deadline = time.monotonic() + self.config.connect_timeout
        failures: dict[str, str] = {}
        reauthenticated = not authenticated or self.config.user is None
        tried_in_cycle = 0
        backoff = 0.05
        while True:
            if self._closed.is_set():
                raise StoreClosedError(f"etcd store for {self._names} is closed")
            with self._lock:
                index = self._current
            name, client = self._endpoints[index]
            attempt_timeout = max(min(self.config.connect_timeout, deadline - time.monotonic()), _MIN_ATTEMPT_TIMEOUT)
            try:
                return self._attempt(
                    name,
                    client,
                    path,
                    payload,
                    idempotent=idempotent,
                    headers=self._headers() if authenticated else {},
                    stream=stream,
                    timeout=(attempt_timeout, read_timeout or self.config.request_timeout),
                )
            except _EtcdApiError as e:
                if e.code == _UNAUTHENTICATED and not reauthenticated:
                    reauthenticated = True  # the token expired: log in again, once
                    self._authenticate()
                    continue
                raise
            except _Retry as e:
                failures[name] = e.reason
                logger.debug("etcd at %s failed %s: %s", name, path, e.reason)
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self._endpoints)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailableError(self._names, self._unreachable_message(failures))
            tried_in_cycle += 1
            if tried_in_cycle >= len(self._endpoints):
                tried_in_cycle = 0
                self._closed.wait(min(backoff, remaining))
                backoff = min(backoff * 2, 1.0)

    def _unreachable_message(self, failures: dict[str, str]) -> str:
        if len(failures) == 1 and len(self._endpoints) == 1:
            detail = next(iter(failures.values()))
        else:
            detail = "; ".join(f"{name}: {reason}" for name, reason in failures.items())
        hint = ""
        if self.config.scheme == "http" and ("without an answer" in detail or "reset by peer" in detail):
            hint = " (if etcd serves TLS, set --rdzv-conf cacert=... or protocol=https)"
        return f"etcd at {self._names} is unreachable after {self.config.connect_timeout:.1f}s: {detail}{hint}"

    def _attempt(
        self,
        name: str,
        client: etcd3gw.Etcd3Client,
        path: str,
        payload: dict[str, Any],
        *,
        idempotent: bool,
        headers: dict[str, str],
        stream: bool,
        timeout: tuple[float, float],
    ) -> requests.Response:
        try:
            response = self._session.post(
                client.get_url(path),
                json=payload,
                headers=headers,
                stream=stream,
                timeout=timeout,
                verify=self._verify,
                cert=self._cert,
            )
        except requests.exceptions.SSLError as e:
            reason = _os_reason(e)
            if "certificate verify failed" in reason:
                hint = " (set --rdzv-conf cacert=... to the CA that signed etcd's certificate)"
            elif self._cert is None:
                hint = " (if etcd requires client certificates, set --rdzv-conf cert=... key=...)"
            else:
                hint = ""
            raise StoreAuthError(f"TLS handshake with etcd at {name} failed: {reason}{hint}") from e
        except requests.ReadTimeout as e:
            raise StoreTimeoutError(f"etcd {path} request to {name}", timeout[1]) from e
        except requests.ConnectionError as e:
            if idempotent or _never_sent(e):
                raise _Retry(_os_reason(e)) from e
            raise StoreUnavailableError(
                name, f"etcd at {name} dropped the connection during {path}; it may have been applied: {_os_reason(e)}"
            ) from e
        if response.status_code == requests.codes.ok:
            return response
        try:
            body = response.json()
        except ValueError:
            body = {}
        finally:
            response.close()
        code = body.get("code") if isinstance(body, dict) else None
        message = str(body.get("message") or body.get("error") or response.reason) if isinstance(body, dict) else ""
        if code == _UNAVAILABLE or response.status_code == 503:
            if idempotent:
                raise _Retry(message)
            raise StoreUnavailableError(name, f"etcd at {name} is unavailable for {path}: {message}")
        if code == _PERMISSION_DENIED or (code == _INVALID_ARGUMENT and "user name is empty" in message):
            hint = "" if self.config.user else " (etcd has auth enabled: set --rdzv-conf user=... password=...)"
            raise StoreAuthError(f"etcd at {name} refused {path}: {message}{hint}")
        raise _EtcdApiError(name, path, response.status_code, code, message)

    # ---- Store

    def _check_revision(self, name: str, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def get(self, key: str) -> Entry | None:
        kvs = self._post("kv/range", {"key": _b64(key.encode())}, idempotent=True).get("kvs", [])
        if not kvs:
            return None
        return Entry(_unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        start, end = _key_range(prefix)
        reply = self._post("kv/range", {"key": _b64(start), "range_end": _b64(end)}, idempotent=True)
        return {
            _unb64(kv["key"]).decode(): Entry(_unb64(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in reply.get("kvs", [])
        }

    def _put_request(self, key: str, value: bytes, lease: Lease | None) -> dict[str, Any]:
        request: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(bytes(value))}
        if lease is not None:
            request["lease"] = lease.id
        return request

    def _lease_error(self, error: _EtcdApiError, lease: Lease | None) -> StoreError:
        if lease is not None and error.code == _NOT_FOUND:
            return LeaseExpiredError(lease.id, error.message)
        return error

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        try:
            reply = self._post("kv/put", self._put_request(key, value, lease), idempotent=False)
        except _EtcdApiError as e:
            raise self._lease_error(e, lease) from e
        return int(reply["header"]["revision"])

    def compare_and_swap(
        self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None
    ) -> bool:
        self._check_revision("expected_revision", expected_revision)
        txn = {
            "compare": [
                {
                    "key": _b64(key.encode()),
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": expected_revision,
                }
            ],
            "success": [{"request_put": self._put_request(key, value, lease)}],
            "failure": [],
        }
        try:
            reply = self._post("kv/txn", txn, idempotent=False)
        except _EtcdApiError as e:
            raise self._lease_error(e, lease) from e
        return bool(reply.get("succeeded", False))

    def delete(self, key: str) -> bool:
        reply = self._post("kv/deleterange", {"key": _b64(key.encode())}, idempotent=False)
        return int(reply.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        start, end = _key_range(prefix)
        reply = self._post("kv/deleterange", {"key": _b64(start), "range_end": _b64(end)}, idempotent=False)
        return int(reply.get("deleted", 0))

    def grant_lease(self, ttl: float) -> Lease:
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"lease ttl must be a finite number > 0, got {ttl!r}")
        reply = self._post("lease/grant", {"TTL": math.ceil(ttl), "ID": 0}, idempotent=False)
        if reply.get("error"):
            raise StoreError(f"etcd at {self._names} refused a lease of {ttl:g}s: {reply['error']}")
        return _EtcdLease(self, int(reply["ID"]), float(reply["TTL"]))

    def current_revision(self) -> int:
        return int(self._post("maintenance/status", {}, idempotent=True)["header"]["revision"])

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        self._check_revision("after_revision", after_revision)
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        start, end = _key_range(prefix)
        request = {
            "create_request": {"key": _b64(start), "range_end": _b64(end), "start_revision": after_revision + 1}
        }
        deadline = time.monotonic() + timeout
        response = self._send("watch", request, idempotent=True, stream=True)
        name = response.url
        sock = _stream_socket(response)
        with self._lock:
            closing = self._closed.is_set()
            self._watches.add(sock)
        try:
            if closing:  # close() ran before it could see this watch
                raise StoreClosedError(f"etcd store for {self._names} is closed")
            for message in _json_lines(response, sock, deadline=deadline):
                result = message.get("result") or {}
                if result.get("canceled"):
                    if "compact_revision" in result:  # history before it is gone: report a change
                        return max(self.current_revision(), after_revision + 1)
                    reason = result.get("cancel_reason", "")
                    if "user name is empty" in reason or "permission denied" in reason or "auth" in reason:
                        raise StoreAuthError(f"etcd refused to watch {prefix!r}: {reason}")
                    raise StoreError(f"etcd cancelled the watch on {prefix!r}: {reason}")
                if result.get("events"):
                    return int(result["header"]["revision"])
                if time.monotonic() >= deadline:
                    return None
        except requests.RequestException as e:
            if self._closed.is_set():
                raise StoreClosedError(f"etcd store for {self._names} was closed during a wait") from e
            if isinstance(e, requests.ConnectionError) and isinstance(
                e.args[0] if e.args else None, urllib3.exceptions.ReadTimeoutError
            ):
                return None
            raise StoreUnavailableError(self._names, f"etcd dropped the watch on {prefix!r} ({name}): {_os_reason(e)}") from e
        finally:
            with self._lock:
                self._watches.discard(sock)
            response.close()
        if self._closed.is_set():
            raise StoreClosedError(f"etcd store for {self._names} was closed during a wait")
        raise StoreUnavailableError(self._names, f"etcd closed the watch on {prefix!r} ({name}) without an answer")

    def close(self) -> None:
        """Close connections; waits in flight on other threads end with StoreClosedError."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            watches = list(self._watches)
        for sock in watches:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._session.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self._names!r}, {self.config.scheme})"


def _stream_socket(response: requests.Response) -> socket.socket | None:
    """The socket under a streamed response (urllib3 exposes it as ``raw.connection.sock``)."""
    return getattr(getattr(response.raw, "connection", None), "sock", None)


def _json_lines(
    response: requests.Response, sock: socket.socket | None, *, deadline: float
) -> Iterator[dict[str, Any]]:
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
