"""Start a real etcd server (Debian's ``etcd-server``) for tests, on free loopback ports.

    with EtcdServer() as etcd:
        store = EtcdStore(EtcdConfig(endpoints=(etcd.endpoint,)))

TLS: ``EtcdServer(tls=make_tls_files(tmp_path))`` serves https with a throwaway CA.
On a test host in a network namespace (support.netns): ``EtcdServer(host=h)``.

Trouble on demand: :meth:`EtcdServer.kill` / :meth:`EtcdServer.restart` stop etcd and start
it again on the same port and data (what an etcd restart does to clients), and
:meth:`EtcdServer.pause` / :meth:`EtcdServer.resume` freeze it with SIGSTOP (a stalled disk
or a long GC pause: connections stay open, nothing answers).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import requests

from support.ports import free_port

if TYPE_CHECKING:
    from support.netns import Host

__all__ = ["EtcdServer", "EtcdTls", "make_tls_files"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EtcdTls:
    """Files for a TLS etcd: the CA, the server's pair and a client pair signed by the CA."""

    cacert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    client_cert_auth: bool = False


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_tls_files(directory: Path, *, client_cert_auth: bool = False) -> EtcdTls:
    """Generate a throwaway CA and server/client certificates (EC P-256) for 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=hyperpodrun test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    (directory / "leaf.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "authorityKeyIdentifier=keyid\n"
    )
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "leaf.ext",
            cwd=directory,
        )
    return EtcdTls(
        cacert=str(directory / "ca.crt"),
        server_cert=str(directory / "server.crt"),
        server_key=str(directory / "server.key"),
        client_cert=str(directory / "client.crt"),
        client_key=str(directory / "client.key"),
        client_cert_auth=client_cert_auth,
    )


class EtcdServer:
    """A single-member etcd in a temporary data directory (in /dev/shm when available).

    With ``host``, etcd runs in that test host's network namespace and serves clients on its
    address (peers on the namespace's loopback); health checks and :meth:`etcdctl` run there too.
    """

    def __init__(
        self, *, tls: EtcdTls | None = None, start_timeout: float = 30.0, attempts: int = 3, host: Host | None = None
    ) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.access(binary, os.X_OK):
            raise RuntimeError("etcd is not installed: apt-get install etcd-server (the tests need a real etcd)")
        self.binary = binary
        self.tls = tls
        self.start_timeout = start_timeout
        self.attempts = attempts
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._args: list[str] = []
        self._log_path = ""

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.host.addr if self.host else '127.0.0.1'}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it reports healthy; retries on a port taken meanwhile."""
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._dir = tempfile.mkdtemp(prefix="hyperpodrun-etcd-", dir=shm)
        last_error = ""
        for attempt in range(self.attempts):
            self.port = self.host.free_port() if self.host else free_port()
            peer = f"http://127.0.0.1:{self.host.free_port() if self.host else free_port()}"
            args = [
                self.binary,
                "--name",
                "test",
                "--data-dir",
                os.path.join(self._dir, f"data{attempt}"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"test={peer}",
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ]
            if self.tls is not None:
                args += ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key]
                args += ["--trusted-ca-file", self.tls.cacert]
                if self.tls.client_cert_auth:
                    args.append("--client-cert-auth")
            self._args, self._log_path = self._in_host(args), os.path.join(self._dir, f"etcd{attempt}.log")
            self._spawn()
            if self._wait_healthy():
                return self
            last_error = Path(self._log_path).read_text(errors="replace")[-2000:]
            self._terminate()
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {self.start_timeout:g}s:\n{last_error}")

    def _spawn(self) -> None:
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """Stop etcd abruptly (SIGKILL), keeping its data, port and configuration."""
        if self._proc is None:
            raise RuntimeError("etcd is not running")
        self._proc.send_signal(signal.SIGCONT)  # in case it was paused
        self._proc.kill()
        self._proc.wait(10)
        self._proc = None

    def restart(self, *, kill: bool = True) -> None:
        """Start etcd again on the same port with the same data; wait until it is healthy."""
        if kill and self._proc is not None:
            self.kill()
        if self._proc is not None:
            raise RuntimeError("etcd is already running")
        self._spawn()
        if not self._wait_healthy():
            tail = Path(self._log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd did not come back on port {self.port} within {self.start_timeout:g}s:\n{tail}")

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open and nothing answers."""
        if self._proc is None:
            raise RuntimeError("etcd is not running")
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is None:
            raise RuntimeError("etcd is not running")
        self._proc.send_signal(signal.SIGCONT)

    def _wait_healthy(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        backoff = 0.02
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if self._healthy():
                return True
            time.sleep(backoff)  # polling an external process; nothing to wait on instead
            backoff = min(backoff * 2, 0.25)
        return False

    def _healthy(self) -> bool:
        if self.host is not None:  # not reachable from this namespace: ask from inside the host's
            try:
                self.etcdctl("endpoint", "health")
                return True
            except RuntimeError:
                return False
        verify: str | bool = self.tls.cacert if self.tls else False
        cert = (self.tls.client_cert, self.tls.client_key) if self.tls else None
        try:
            reply = requests.get(f"{self.url}/health", verify=verify, cert=cert, timeout=2.0)
            return reply.ok and reply.json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def _in_host(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.host.netns, *argv] if self.host else argv

    def etcdctl(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run ``etcdctl`` (v3 API) against this server; returns its stdout."""
        command = ["etcdctl", f"--endpoints={self.url}", "--command-timeout=20s"]
        if self.tls is not None:
            command += [f"--cacert={self.tls.cacert}", f"--cert={self.tls.client_cert}", f"--key={self.tls.client_key}"]
        run_env = {**os.environ, "ETCDCTL_API": "3", **(env or {})}
        done = subprocess.run(
            self._in_host([*command, *args]), capture_output=True, text=True, timeout=30, env=run_env, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def _terminate(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)
        self._proc = None

    def stop(self) -> None:
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
