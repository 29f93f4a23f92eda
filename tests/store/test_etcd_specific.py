"""etcd-only behaviour: endpoint fail-over, bounded unreachability, TLS, auth, compaction."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3gw
import pytest

from hyperpodrun.store import (
    EtcdConfig,
    EtcdStore,
    LeaseKeeper,
    PrefixedStore,
    StoreAuthError,
    StoreConfigError,
    StoreUnavailableError,
    create_store,
    job_prefix,
)
from support.etcd import EtcdServer, EtcdTls, make_tls_files
from support.ports import free_port

SLACK = 4.0  # scheduling slack on a shared 2-core machine


def _elapsed(since: float) -> float:
    return time.monotonic() - since


def test_unreachable_endpoint_fails_within_connect_timeout() -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        EtcdStore(EtcdConfig(endpoints=(dead,), connect_timeout=1.0))
    elapsed = _elapsed(started)

    assert 0.9 <= elapsed < 1.0 + SLACK  # it kept retrying for the whole timeout, no longer
    assert str(info.value) == f"etcd at {dead} is unreachable after 1.0s: connection refused"
    assert info.value.endpoint == dead


def test_every_dead_endpoint_is_named() -> None:
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with pytest.raises(StoreUnavailableError) as info:
        create_store("etcd", ",".join(dead), run_id="job", conf={}, timeout=0.5)
    message = str(info.value)
    assert message.startswith(f"etcd at {dead[0]},{dead[1]} is unreachable after 0.5s: ")
    assert f"{dead[0]}: connection refused" in message and f"{dead[1]}: connection refused" in message


def test_fails_over_to_a_live_endpoint(etcd_server: EtcdServer, run_id: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with create_store("etcd", f"{dead}, {etcd_server.endpoint}", run_id=run_id, conf={}, timeout=10.0) as store:
        rev = store.put("k", b"v")
        entry = store.get("k")
        assert store.wait_for_change("k", after_revision=rev - 1, timeout=5.0) == rev
    assert entry is not None and entry.value == b"v"
    assert _elapsed(started) < 10.0  # a refused endpoint is skipped at once, not after the timeout
    with create_store("etcd", etcd_server.endpoint, run_id=run_id, conf={}, timeout=10.0) as direct:
        assert direct.get("k") == entry


def test_gateway_path_matches_etcd3gw_discovery(etcd_server: EtcdServer) -> None:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    discovered = etcd3gw.Etcd3Client(host=host, port=int(port), timeout=10).api_path
    assert discovered == EtcdConfig(endpoints=(etcd_server.endpoint,)).api_path == "/v3/"


def test_wait_after_compaction_reports_a_change(etcd_server: EtcdServer, run_id: str) -> None:
    with create_store("etcd", etcd_server.endpoint, run_id=run_id, conf={}, timeout=10.0) as store:
        old = store.put("c/k", b"1")
        store.put("c/k", b"2")
        latest = store.put("other", b"3")
        etcd_server.etcdctl("compaction", str(latest))
        started = time.monotonic()
        # Events after ``old`` were compacted away: a change must be assumed, at once.
        assert store.wait_for_change("c/", after_revision=old, timeout=20.0) == latest
        assert _elapsed(started) < 10.0


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> EtcdTls:
    return make_tls_files(Path(tmp_path_factory.mktemp("tls")), client_cert_auth=True)


@pytest.fixture(scope="module")
def tls_etcd(tls_files: EtcdTls) -> Iterator[EtcdServer]:
    with EtcdServer(tls=tls_files) as server:
        yield server


def test_tls_with_client_certificates(tls_etcd: EtcdServer, tls_files: EtcdTls, run_id: str) -> None:
    conf = {"cacert": tls_files.cacert, "cert": tls_files.client_cert, "key": tls_files.client_key}
    with create_store("etcd", tls_etcd.endpoint, run_id=run_id, conf=conf, timeout=10.0) as store:
        assert isinstance(store, PrefixedStore) and isinstance(store.inner, EtcdStore)
        assert store.inner.config.scheme == "https"  # inferred from cacert/cert
        rev = store.put("k", b"over tls")
        assert store.get("k").value == b"over tls"
        assert store.wait_for_change("", after_revision=rev - 1, timeout=5.0) == rev


@pytest.mark.parametrize(
    ("conf_keys", "error", "match"),
    [
        (("cacert",), StoreAuthError, r"TLS handshake .* failed: .*set --rdzv-conf cert=\.\.\. key=\.\.\."),
        (("cert", "key"), StoreAuthError, r"certificate verify failed.*set --rdzv-conf cacert="),
        ((), StoreUnavailableError, r"is unreachable after 1\.0s: .* \(if etcd serves TLS, set --rdzv-conf cacert="),
    ],
    ids=["no-client-cert", "untrusted-server", "plain-http"],
)
def test_tls_misconfiguration_is_reported(
    tls_etcd: EtcdServer, tls_files: EtcdTls, conf_keys: tuple[str, ...], error: type[Exception], match: str
) -> None:
    files = {"cacert": tls_files.cacert, "cert": tls_files.client_cert, "key": tls_files.client_key}
    conf = {key: files[key] for key in conf_keys}
    with pytest.raises(error, match=match):
        create_store("etcd", tls_etcd.endpoint, run_id="job", conf=conf, timeout=1.0)


# --------------------------------------------------------------------------- auth

ROOT = ("root", "root-secret")
ALICE = ("alice", "alice-secret")
ALICE_JOB = "alice-job"


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EtcdServer]:
    """etcd with authentication on: ``root`` sees everything, ``alice`` only her job."""
    with EtcdServer() as server:
        server.etcdctl("user", "add", f"{ROOT[0]}:{ROOT[1]}", "--interactive=false")
        server.etcdctl("user", "add", f"{ALICE[0]}:{ALICE[1]}", "--interactive=false")
        server.etcdctl("role", "add", "alice-job")
        server.etcdctl("role", "grant-permission", "alice-job", "readwrite", "--prefix=true", job_prefix(ALICE_JOB))
        server.etcdctl("user", "grant-role", ALICE[0], "alice-job")
        server.etcdctl("auth", "enable")
        yield server


def _login(server: EtcdServer, run_id: str, user: tuple[str, str] | None) -> PrefixedStore:
    # This test server speaks plain http; a password over it must be allowed explicitly.
    conf = {} if user is None else {"user": user[0], "password": user[1], "insecure": "true"}
    store = create_store("etcd", server.endpoint, run_id=run_id, conf=conf, timeout=5.0)
    assert isinstance(store, PrefixedStore)
    return store


@pytest.mark.parametrize(("user", "run"), [(ROOT, "root-job"), (ALICE, ALICE_JOB)], ids=["root", "scoped-user"])
def test_authenticated_user_can_use_the_whole_api(auth_etcd: EtcdServer, user: tuple[str, str], run: str) -> None:
    with _login(auth_etcd, run, user) as store:
        lease = store.grant_lease(2)
        with LeaseKeeper(lease) as keeper:
            rev = store.put("members/0", b"x", lease=lease)
            assert store.compare_and_swap("leader", b"0", expected_revision=0)
            assert store.get_prefix("members/") == {"members/0": store.get("members/0")}
            assert store.wait_for_change("members/", after_revision=rev - 1, timeout=5.0) is not None
            assert store.current_revision() >= rev
            assert not keeper.lost
        lease.revoke()
        assert store.delete_prefix("") == 1


def test_expired_token_is_renewed(auth_etcd: EtcdServer) -> None:
    with _login(auth_etcd, "renew", ROOT) as store:
        assert isinstance(store.inner, EtcdStore)
        store.inner._token = "stale-token"  # what etcd's token TTL does to an idle agent
        assert store.put("k", b"v") > 0
        assert store.inner._token != "stale-token"


@pytest.mark.parametrize(
    ("user", "match"),
    [
        (("root", "wrong"), r"rejected user 'root': .*invalid user ID or password"),
        (None, r"auth enabled: set --rdzv-conf user=\.\.\. password=\.\.\."),
    ],
    ids=["wrong-password", "no-credentials"],
)
def test_bad_credentials_are_an_auth_error(auth_etcd: EtcdServer, user: tuple[str, str] | None, match: str) -> None:
    with pytest.raises(StoreAuthError, match=match):
        _login(auth_etcd, "job", user)


def test_scoped_user_cannot_touch_another_job(auth_etcd: EtcdServer) -> None:
    with _login(auth_etcd, "someone-else", ALICE) as store:
        with pytest.raises(StoreAuthError, match="permission denied"):
            store.put("k", b"v")
        with pytest.raises(StoreAuthError, match="permission denied"):
            store.get("k")


# --------------------------------------------------------------------------- configuration


@pytest.fixture
def a_file(tmp_path: Path) -> str:
    path = tmp_path / "some.pem"
    path.write_text("not checked before use")
    return str(path)


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"ca_cert": "FILE"}, r"unknown --rdzv-conf key 'ca_cert' \(did you mean 'cacert'\?\)"),
        ({"tls_key": "FILE"}, r"unknown --rdzv-conf key 'tls_key'"),
        ({"passwd": "x"}, r"'passwd' \(did you mean 'password'\?\)"),
        ({"cert": "FILE"}, r"key is required when cert is given"),
        ({"cacert": "/nonexistent/ca.pem"}, r"cacert: file '/nonexistent/ca.pem' does not exist"),
        ({"protocol": "ftp"}, r"protocol must be http or https"),
        ({"protocol": "http", "cacert": "FILE"}, r"protocol 'http' contradicts cacert"),
        ({"user": "alice"}, r"password is required when user is given"),
        ({"cacert": ""}, r"--rdzv-conf cacert needs a value"),
        ({"user": "alice", "password": "pw"}, r"refusing to send the etcd password over plain http"),
        ({"user": "alice", "password": "pw", "insecure": "maybe"}, r"insecure must be true or false"),
        ({"secret_file": "FILE"}, r"secret_file=\.\.\. applies only to --rdzv-backend embedded"),
    ],
)
def test_bad_conf_is_rejected_before_connecting(conf: dict[str, str], match: str, a_file: str) -> None:
    conf = {k: a_file if v == "FILE" else v for k, v in conf.items()}
    dead = f"127.0.0.1:{free_port()}"  # a config error must win over the unreachable endpoint
    with pytest.raises(StoreConfigError, match=match):
        create_store("etcd", dead, run_id="job", conf=conf, timeout=30.0)


def test_rendezvous_conf_keys_are_left_alone(etcd_server: EtcdServer, run_id: str) -> None:
    conf = {"join_timeout": "600", "last_call_timeout": "30", "read_timeout": "60", "is_host": "1"}
    with contextlib.closing(create_store("etcd-v3", etcd_server.endpoint, run_id=run_id, conf=conf, timeout=5.0)) as s:
        assert s.put("k", b"v") > 0


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [("", r"needs --rdzv-endpoint"), ("http://127.0.0.1:2379", r"without a scheme"), ("h:99999", r"invalid port")],
)
def test_bad_endpoint_is_rejected(endpoint: str, match: str) -> None:
    with pytest.raises(StoreConfigError, match=match):
        create_store("etcd", endpoint, run_id="job", conf={}, timeout=1.0)


def test_etcd_is_never_hosted(etcd_server: EtcdServer) -> None:
    with pytest.raises(StoreConfigError, match="host= applies only to the embedded store"):
        create_store("etcd", etcd_server.endpoint, run_id="job", conf={}, host=True, timeout=1.0)
