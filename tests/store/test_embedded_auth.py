"""The embedded store's shared secret, the ranks' scrubbed environment, and reconnects."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpodrun.security import run_id_problem, scrub_secrets
from hyperpodrun.store import (
    EmbeddedStoreClient,
    EmbeddedStoreGoneError,
    EmbeddedStoreServer,
    StoreAuthError,
    StoreConfigError,
    create_store,
)
from hyperpodrun.store.auth import local_secret_path
from hyperpodrun.store.wire import PROTOCOL_VERSION, b64, recv_frame, send_frame

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def guarded() -> Iterator[EmbeddedStoreServer]:
    with EmbeddedStoreServer("127.0.0.1", 0, secret=SECRET) as server:
        yield server


def test_the_right_secret_gets_in(guarded: EmbeddedStoreServer) -> None:
    with EmbeddedStoreClient(guarded.endpoint, secret=SECRET) as client:
        rev = client.put("k", b"v")
        assert client.get("k") is not None and client.get("k").revision == rev


@pytest.mark.parametrize(
    ("secret", "match"),
    [
        (None, "requires the job's shared secret: set --rdzv-conf secret_file=PATH or HYPERPODRUN_STORE_SECRET"),
        (b"x" * 32, r"refused this job's secret \(wrong secret\?\)"),
    ],
    ids=["none", "wrong"],
)
def test_a_client_without_the_secret_is_refused(guarded: EmbeddedStoreServer, secret: bytes | None, match: str) -> None:
    with pytest.raises(StoreAuthError, match=match):
        EmbeddedStoreClient(guarded.endpoint, secret=secret, connect_timeout=2.0)


def test_a_secret_left_by_an_exited_publisher_is_not_sent(guarded: EmbeddedStoreServer) -> None:
    """An agent killed before it removed its published secret leaves the file behind; a later server on the
    same port is not that agent's, so the client must not send that secret (nor take it for this store's)."""
    port = int(guarded.endpoint.rsplit(":", 1)[1])
    publish = (
        f"from hyperpodrun.store.auth import publish_local_secret; publish_local_secret('127.0.0.1', {port}, b'x' * 32)"
    )
    subprocess.run([sys.executable, "-c", publish], check=True, timeout=60)
    try:
        assert local_secret_path("127.0.0.1", port).exists()
        with pytest.raises(StoreAuthError, match="requires the job's shared secret"):
            EmbeddedStoreClient(guarded.endpoint, connect_timeout=2.0)
    finally:
        local_secret_path("127.0.0.1", port).unlink(missing_ok=True)


def test_a_server_that_asks_no_proof_is_checked_against_this_hosts_secret_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hosting agent publishes its secret after it listens, so a proof-less server is never one half-started:
    the client reads the published secret once and does not poll for one (which cost 2 s per connection)."""
    import hyperpodrun.store.embedded as embedded

    reads: list[tuple[str, int]] = []

    def none_published(host: str, port: int) -> bytes | None:
        reads.append((host, port))
        return None

    monkeypatch.setattr(embedded, "read_local_secret", none_published)
    with EmbeddedStoreServer("127.0.0.1", 0) as open_server, EmbeddedStoreClient(open_server.endpoint) as client:
        client.put("k", b"v")
    assert len(reads) == 1, reads


def _raw(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    return sock


def test_requests_before_the_handshake_write_nothing(guarded: EmbeddedStoreServer) -> None:
    with _raw(guarded.endpoint) as sock:
        send_frame(sock, {"op": "put", "key": "k", "value": b64(b"evil"), "lease": 0})
        reply = recv_frame(sock)
        assert reply is not None and reply["error"]["kind"] == "protocol"
        assert recv_frame(sock) is None  # and the connection is closed
    with _raw(guarded.endpoint) as sock:  # a forged proof
        send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "nonce": "n"})
        assert recv_frame(sock)["ok"]["auth"] is True
        send_frame(sock, {"op": "auth", "proof": "0" * 64})
        assert recv_frame(sock)["error"]["kind"] == "auth"
        assert recv_frame(sock) is None
    with EmbeddedStoreClient(guarded.endpoint, secret=SECRET) as client:
        assert client.get("k") is None


def test_a_multi_node_store_needs_a_secret(run_id: str) -> None:
    with pytest.raises(StoreConfigError, match="reachable from other hosts, so the job needs a shared secret"):
        create_store("embedded", "192.0.2.1:29400", run_id=run_id, conf={}, timeout=0.3, env={})


def test_a_loopback_store_generates_a_secret_only_its_user_reads(run_id: str) -> None:
    host = create_store("embedded", "127.0.0.1:0", run_id=run_id, conf={}, host=True, timeout=5.0, env={})
    endpoint = host.inner.endpoint
    path = local_secret_path("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with create_store("embedded", endpoint, run_id=run_id, conf={}, host=False, timeout=5.0, env={}) as other:
        other.put("k", b"v")
        assert host.get("k").value == b"v"
    with pytest.raises(StoreAuthError, match="wrong secret"):
        EmbeddedStoreClient(endpoint, secret=b"y" * 32, connect_timeout=2.0)
    host.close()
    assert not path.exists()


def test_secret_from_file_and_env(tmp_path: Path, run_id: str) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    secret_file.chmod(0o600)
    conf = {"secret_file": str(secret_file)}
    with create_store("embedded", "127.0.0.1:0", run_id=run_id, conf=conf, host=True, timeout=5.0, env={}) as host:
        endpoint = host.inner.endpoint
        env = {"HYPERPODRUN_STORE_SECRET": SECRET.decode()}
        with create_store("embedded", endpoint, run_id=run_id, conf={}, host=False, timeout=5.0, env=env) as peer:
            assert peer.put("k", b"v") > 0


@pytest.mark.parametrize(
    ("content", "mode", "match"),
    [
        (SECRET, 0o604, r"is accessible to other users; chmod o-rwx"),
        (b"short", 0o600, r"the store secret must be at least 16 characters"),
        (None, 0o600, r"cannot read .*No such file or directory"),
    ],
    ids=["world-readable", "too-short", "missing"],
)
def test_bad_secret_files_are_refused(
    tmp_path: Path, run_id: str, content: bytes | None, mode: int, match: str
) -> None:
    secret_file = tmp_path / "secret"
    if content is not None:
        secret_file.write_bytes(content)
        secret_file.chmod(mode)
    with pytest.raises(StoreConfigError, match=match):
        create_store("embedded", "127.0.0.1:0", run_id=run_id, conf={"secret_file": str(secret_file)}, timeout=1.0)


# --------------------------------------------------------------------------- reconnects


def _drop_server_side(server: EmbeddedStoreServer) -> None:
    """What a network blip does: the server's end of every connection goes away."""
    for conn in list(server._conns):
        with contextlib.suppress(OSError):  # one whose client end is already gone, not yet removed by the server
            conn.shutdown(socket.SHUT_RDWR)


def test_reads_and_cas_ride_out_a_dropped_connection(guarded: EmbeddedStoreServer) -> None:
    with EmbeddedStoreClient(guarded.endpoint, secret=SECRET) as client:
        rev = client.put("k", b"v1")
        _drop_server_side(guarded)
        assert client.get("k").value == b"v1"
        _drop_server_side(guarded)
        assert client.compare_and_swap("k", b"v2", expected_revision=rev)
        assert client.current_revision() == rev + 1  # applied exactly once
        assert not client.compare_and_swap("k", b"v3", expected_revision=rev)


def test_a_write_that_may_have_been_applied_is_not_resent(guarded: EmbeddedStoreServer) -> None:
    with EmbeddedStoreClient(guarded.endpoint, secret=SECRET) as client:
        client.put("k", b"v1")
        _drop_server_side(guarded)
        with pytest.raises(EmbeddedStoreGoneError):
            client.put("k", b"v2")
        assert client.get("k").value == b"v1"


# --------------------------------------------------------------------------- security helpers


def test_scrub_secrets_removes_credentials_only() -> None:
    env = {
        "PATH": "/usr/bin",
        "HYPERPODRUN_STORE_SECRET": "s",
        "ETCDCTL_PASSWORD": "p",
        "PET_RDZV_CONF": "user=u,password=p,join_timeout=60,secret_file=/run/s",
    }
    assert scrub_secrets(env) == {"PATH": "/usr/bin", "PET_RDZV_CONF": "user=u,join_timeout=60,secret_file=/run/s"}
    assert scrub_secrets({"PET_RDZV_CONF": "password=p"}) == {}
    assert env["ETCDCTL_PASSWORD"] == "p"  # the agent's own copy is untouched


@pytest.mark.parametrize(
    ("run_id", "ok"),
    [
        ("llama-ft", True),
        ("Job_1.v2", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("-x", False),
        ("x-", False),
        ("a/b", False),
        ("..", False),
        ("a b", False),
        ("", False),
    ],
)
def test_run_id_pattern(run_id: str, ok: bool) -> None:
    assert (run_id_problem(run_id) is None) is ok


def test_private_dir_is_not_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    planted = tmp_path / f"hyperpodrun-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # someone else could have made it (or reads it)
    with pytest.raises(StoreConfigError, match="with mode 0700"):
        local_secret_path("127.0.0.1", 1)
