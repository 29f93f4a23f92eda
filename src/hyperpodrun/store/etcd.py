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

import contextlib
import logging
import math
import socket
import threading
import time
from typing import Any

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
    format_endpoint,
    parse_endpoint,
)
from hyperpodrun.store.etcd_support import (
    DEFAULT_PORT,
    INVALID_ARGUMENT,
    MIN_ATTEMPT_TIMEOUT,
    NOT_APPLIED,
    NOT_FOUND,
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    Backoff,
    Broken,
    EtcdApiError,
    EtcdConfig,
    Retry,
    b64,
    json_lines,
    key_range,
    never_sent,
    os_reason,
    stream_socket,
    unb64,
)

__all__ = ["DEFAULT_PORT", "EtcdConfig", "EtcdStore"]

logger = logging.getLogger(__name__)


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
        except EtcdApiError as e:
            if e.code != NOT_FOUND:
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
                self._post("kv/range", {"key": b64(KEY_ROOT.encode()), "count_only": True}, idempotent=True)
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
        except EtcdApiError as e:
            raise StoreAuthError(f"etcd at {self._names} rejected user {self.config.user!r}: {e.message}") from e
        with self._lock:
            self._token = reply.get("token") or None

    def _post(
        self,
        path: str,
        payload: dict[str, Any],
        *,
        idempotent: bool,
        authenticated: bool = True,
        retries: list[str] | None = None,
    ) -> dict[str, Any]:
        response = self._send(path, payload, idempotent=idempotent, authenticated=authenticated, retries=retries)
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
        retries: list[str] | None = None,
    ) -> requests.Response:
        """POST to the first endpoint that answers, trying each in turn until the deadline.

        Resent (after a jittered, growing pause once every endpoint failed) when that is
        safe: the request never reached etcd, etcd answered that it did not apply it, or
        it is ``idempotent``. Each retry's reason is appended to ``retries``.
        """
        deadline = time.monotonic() + self.config.connect_timeout
        failures: dict[str, str] = {}
        reauthenticated = not authenticated or self.config.user is None
        tried_in_cycle = 0
        backoff = Backoff()
        while True:
            if self._closed.is_set():
                raise StoreClosedError(f"etcd store for {self._names} is closed")
            with self._lock:
                index = self._current
            name, client = self._endpoints[index]
            attempt_timeout = max(min(self.config.connect_timeout, deadline - time.monotonic()), MIN_ATTEMPT_TIMEOUT)
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
            except EtcdApiError as e:
                if e.code == UNAUTHENTICATED and not reauthenticated:
                    reauthenticated = True  # the token expired: log in again, once
                    self._authenticate()
                    continue
                raise
            except Retry as e:
                failures[name] = e.reason
                if retries is not None:
                    retries.append(e.reason)
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
                self._closed.wait(min(backoff.next(), remaining))

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
            reason = os_reason(e)
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
            if idempotent or never_sent(e):
                raise Retry(os_reason(e)) from e
            raise StoreUnavailableError(
                name, f"etcd at {name} dropped the connection during {path}; it may have been applied: {os_reason(e)}"
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
        if code == UNAVAILABLE or response.status_code == 503:
            if idempotent or any(phrase in message for phrase in NOT_APPLIED):
                raise Retry(message)
            raise StoreUnavailableError(name, f"etcd at {name} is unavailable for {path}: {message}")
        if code == PERMISSION_DENIED or (code == INVALID_ARGUMENT and "user name is empty" in message):
            hint = "" if self.config.user else " (etcd has auth enabled: set --rdzv-conf user=... password=...)"
            raise StoreAuthError(f"etcd at {name} refused {path}: {message}{hint}")
        raise EtcdApiError(name, path, response.status_code, code, message)

    # ---- Store

    def _check_revision(self, name: str, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def get(self, key: str) -> Entry | None:
        kvs = self._post("kv/range", {"key": b64(key.encode())}, idempotent=True).get("kvs", [])
        if not kvs:
            return None
        return Entry(unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        start, end = key_range(prefix)
        reply = self._post("kv/range", {"key": b64(start), "range_end": b64(end)}, idempotent=True)
        return {
            unb64(kv["key"]).decode(): Entry(unb64(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in reply.get("kvs", [])
        }

    def _put_request(self, key: str, value: bytes, lease: Lease | None) -> dict[str, Any]:
        request: dict[str, Any] = {"key": b64(key.encode()), "value": b64(bytes(value))}
        if lease is not None:
            request["lease"] = lease.id
        return request

    def _lease_error(self, error: EtcdApiError, lease: Lease | None) -> StoreError:
        if lease is not None and error.code == NOT_FOUND:
            return LeaseExpiredError(lease.id, error.message)
        return error

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        try:
            reply = self._post("kv/put", self._put_request(key, value, lease), idempotent=False)
        except EtcdApiError as e:
            raise self._lease_error(e, lease) from e
        return int(reply["header"]["revision"])

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        self._check_revision("expected_revision", expected_revision)
        txn = {
            "compare": [
                {
                    "key": b64(key.encode()),
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": expected_revision,
                }
            ],
            "success": [{"request_put": self._put_request(key, value, lease)}],
            "failure": [],
        }
        retries: list[str] = []
        try:  # resending cannot apply it twice: the first copy applied moves the key's revision
            reply = self._post("kv/txn", txn, idempotent=True, retries=retries)
        except EtcdApiError as e:
            raise self._lease_error(e, lease) from e
        if reply.get("succeeded", False):
            return True
        if not retries:
            return False
        # Resent: a failed compare may mean our first copy was applied. It was if the key
        # holds our value, under our lease, written after the revision we expected.
        kvs = self._post("kv/range", {"key": b64(key.encode())}, idempotent=True).get("kvs", [])
        if not kvs:
            return False
        kv = kvs[0]
        return (
            unb64(kv.get("value", "")) == bytes(value)
            and int(kv["mod_revision"]) > expected_revision
            and int(kv.get("lease", 0)) == (lease.id if lease is not None else 0)
        )

    def delete(self, key: str) -> bool:
        reply = self._post("kv/deleterange", {"key": b64(key.encode())}, idempotent=False)
        return int(reply.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        start, end = key_range(prefix)
        reply = self._post("kv/deleterange", {"key": b64(start), "range_end": b64(end)}, idempotent=False)
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
        """See :meth:`Store.wait_for_change`. A watch stream that breaks (etcd restarted, a
        proxy dropped it) is opened again from ``after_revision`` until ``timeout``: no
        event can be missed, since the wait returns at the first one. Only an etcd that
        stays unreachable for ``connect_timeout`` ends the wait with an error."""
        self._check_revision("after_revision", after_revision)
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while True:
            outcome = self._watch_once(prefix, after_revision=after_revision, deadline=deadline)
            if not isinstance(outcome, Broken):
                return outcome
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            logger.info(
                "etcd watch on %r broke (%s); watching again from revision %d",
                prefix,
                outcome.reason,
                after_revision + 1,
            )
            if self._closed.wait(min(backoff.next(), remaining)):
                raise StoreClosedError(f"etcd store for {self._names} was closed during a wait")

    def _watch_once(self, prefix: str, *, after_revision: int, deadline: float) -> int | None | Broken:
        """One watch stream: the revision of a change, ``None`` at the deadline, or why it broke."""
        start, end = key_range(prefix)
        request = {"create_request": {"key": b64(start), "range_end": b64(end), "start_revision": after_revision + 1}}
        response = self._send("watch", request, idempotent=True, stream=True)
        name = response.url
        sock = stream_socket(response)
        with self._lock:
            closing = self._closed.is_set()
            self._watches.add(sock)
        try:
            if closing:  # close() ran before it could see this watch
                raise StoreClosedError(f"etcd store for {self._names} is closed")
            for message in json_lines(response, sock, deadline=deadline):
                result = message.get("result") or {}
                if result.get("canceled"):
                    if "compact_revision" in result:  # history before it is gone: report a change, callers re-read
                        return max(self.current_revision(), after_revision + 1)
                    reason = result.get("cancel_reason", "")
                    if "user name is empty" in reason or "permission denied" in reason or "auth" in reason:
                        raise StoreAuthError(f"etcd refused to watch {prefix!r}: {reason}")
                    return Broken(f"etcd cancelled it: {reason}")
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
            return Broken(f"{name}: {os_reason(e)}")
        except ValueError as e:  # a message cut in half by the server going away
            return Broken(f"{name}: {e}")
        finally:
            with self._lock:
                self._watches.discard(sock)
            response.close()
        if self._closed.is_set():
            raise StoreClosedError(f"etcd store for {self._names} was closed during a wait")
        return Broken(f"{name} ended the stream")

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
