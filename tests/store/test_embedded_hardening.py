"""The embedded store against peers that do not know the secret: no thread, little memory and a
deadline for them, no proof handed to them, and no request sent to a program that holds the
port without proving the secret. Each test failed on the code before issue 24 (a thread per
connection, 64 MiB frames before authentication, a per-read timeout, the server's proof first,
and a client that skipped the server's proof when it answered ``"auth": false``)."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from hyperpodrun.store import EmbeddedStoreClient, StoreAuthError, create_store
from hyperpodrun.store.handshake import HANDSHAKE_DEADLINE_S
from hyperpodrun.store.wire import PROTOCOL_VERSION, recv_frame, send_frame
from support.impostor import Impostor

SECRET = b"0123456789abcdef0123456789abcdef"
MiB = 1024 * 1024

_SERVE = """
import sys, time
from hyperpodrun.store import EmbeddedStoreServer
server = EmbeddedStoreServer("127.0.0.1", 0, secret=sys.argv[1].encode()).start()
print(server.endpoint, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def server() -> Iterator[tuple[str, psutil.Process]]:
    """An embedded store in a process of its own, so its threads and memory are its own."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, SECRET.decode()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint, "the server did not start"
        yield endpoint, psutil.Process(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def _connect(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def _closed_by_peer(sock: socket.socket, *, within: float) -> float | None:
    """Seconds until the peer closed ``sock`` (None: still open after ``within``)."""
    start = time.monotonic()
    while (left := within - (time.monotonic() - start)) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if ready:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except OSError:
                return time.monotonic() - start
    return None


def test_idle_unauthenticated_connections_get_no_thread(server, record_property) -> None:
    endpoint, proc = server
    before = proc.num_threads()
    idle = []
    try:
        for _ in range(300):
            idle.append(_connect(endpoint))
        time.sleep(0.5)  # the measured state: the server has accepted what it will
        threads = proc.num_threads()
        record_property("threads_under_300_idle", threads)
        assert threads <= 64, threads
        assert threads - before <= 2
        # a client that knows the secret still gets in once the idle ones reach their deadline
        with EmbeddedStoreClient(endpoint, secret=SECRET, connect_timeout=3 * HANDSHAKE_DEADLINE_S) as client:
            client.put("k", b"v")
    finally:
        for sock in idle:
            sock.close()


def test_half_sent_large_frames_before_authentication_do_not_grow_the_server(server, record_property) -> None:
    endpoint, proc = server
    before = proc.memory_info().rss
    senders = []

    def half_a_frame() -> None:
        with contextlib.suppress(OSError), _connect(endpoint) as sock:
            sock.sendall(struct.pack("!I", 60 * MiB) + b"x" * (30 * MiB))  # half of a 60 MiB "hello"
            _closed_by_peer(sock, within=3.0)

    for _ in range(4):
        senders.append(threading.Thread(target=half_a_frame))
        senders[-1].start()
    for sender in senders:
        sender.join(30)
    grown = (proc.memory_info().rss - before) / MiB
    record_property("rss_growth_mib_after_4_half_sent_60mib_frames", round(grown, 1))
    assert grown <= 64, f"{grown:.0f} MiB"


def test_a_slow_sender_is_dropped_at_the_handshake_deadline(server, record_property) -> None:
    endpoint, _ = server
    hello = struct.pack("!I", 200) + b'{"op":"hello"'
    with _connect(endpoint) as sock:
        start = time.monotonic()
        closed = None
        for byte in hello:  # one byte a second, never a whole frame
            with contextlib.suppress(OSError):
                sock.send(bytes([byte]))
            closed = _closed_by_peer(sock, within=1.0)
            if closed is not None:
                break
        took = time.monotonic() - start
    record_property("slow_sender_dropped_after_s", round(took, 2))
    assert closed is not None and took <= HANDSHAKE_DEADLINE_S + 1.5, took


def test_the_server_proves_nothing_before_the_client_did(server) -> None:
    endpoint, _ = server
    with _connect(endpoint) as sock:
        send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "nonce": "chosen-by-the-peer"})
        hello = recv_frame(sock)["ok"]
        assert hello["auth"] is True and "proof" not in hello  # nothing to guess a weak secret offline from
        send_frame(sock, {"op": "auth", "proof": "0" * 64})
        assert recv_frame(sock)["error"]["kind"] == "auth"


@pytest.mark.parametrize("auth", [False, True], ids=["claims-no-auth", "fakes-a-proof"])
def test_a_client_that_holds_a_secret_sends_an_impostor_nothing(auth: bool) -> None:
    impostor = Impostor(auth=auth)
    try:
        with pytest.raises(StoreAuthError, match="not this job's embedded store"):
            EmbeddedStoreClient(impostor.endpoint, secret=SECRET, connect_timeout=2.0)
    finally:
        impostor.close()
    assert [f["op"] for f in impostor.frames] in (["hello"], ["hello", "auth"])  # no get, no put


def test_an_agent_whose_loopback_port_is_taken_by_another_program_does_not_join_it(run_id: str) -> None:
    """With c10d and a fixed loopback endpoint, an agent that found the port taken became a client of
    whoever held it: another local user could take the job over."""
    impostor = Impostor(auth=False)
    try:
        with pytest.raises(StoreAuthError, match="does not prove it knows this job's secret"):
            create_store("c10d", impostor.endpoint, run_id=run_id, conf={}, timeout=2.0, env={})
    finally:
        impostor.close()
    assert [f["op"] for f in impostor.frames] == ["hello"]


def test_a_host_name_that_resolves_to_loopback_hosts_a_local_store_and_says_so(
    run_id: str, caplog, monkeypatch
) -> None:
    """--rdzv-endpoint $(hostname):PORT with /etc/hosts mapping the name to 127.0.1.1: the store could be
    reached from this machine only, silently; other nodes got "connection refused"."""
    real = socket.getaddrinfo

    def hosts_file(host, *args, **kwargs):  # this machine's /etc/hosts: "127.0.0.1 node-a.example"
        return real("127.0.0.1" if host == "node-a.example" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hosts_file)
    with create_store("c10d", "node-a.example:0", run_id=run_id, conf={}, host=True, timeout=5.0, env={}) as host:
        port = host.inner.endpoint.rsplit(":", 1)[1]
        with create_store("c10d", f"node-a.example:{port}", run_id=run_id, conf={}, timeout=5.0, env={}) as peer:
            peer.put("k", b"v")  # a second agent on this machine joins with the published per-user secret
            assert host.get("k").value == b"v"
    warnings = [r.getMessage() for r in caplog.records if "resolves to" in r.getMessage()]
    assert warnings and "node-a.example resolves to 127.0.0.1 (loopback)" in warnings[0]
    assert "agents on other machines cannot reach the store there" in warnings[0]
