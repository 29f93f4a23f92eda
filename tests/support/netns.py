"""Two "hosts" on one machine: network namespaces joined by a veth pair (tests only, needs root).

    with two_hosts() as (a, b):
        subprocess.run(a.wrap(["python", "-c", "..."]))   # runs on host a

Each host is a network namespace with loopback and one end of the veth pair
(``10.R.R.1/24`` and ``10.R.R.2/24``, a random subnet that exists only inside the two
namespaces). A command run through :meth:`Host.wrap` also gets its own hostname, which its
private ``/etc/hosts`` maps to ``127.0.1.1`` -- as in many containers and on Debian hosts --
so software that advertises "the address of my hostname" advertises a loopback address, the
way it does on real machines set up like that.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["Host", "two_hosts"]

# $0 is a placeholder; $1 the hostname, $2 the private hosts file, the rest the command.
_ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class Host:
    """One network namespace with an address on the veth link and its own hostname."""

    netns: str
    addr: str
    hostname: str
    hosts_file: Path

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run in this namespace under this host's hostname and ``/etc/hosts``.

        ``ip netns exec``, ``unshare`` and ``sh`` each exec the next, so the returned command's
        process *is* ``argv`` once started (signals sent to it reach ``argv`` directly).
        """
        enter = ["unshare", "--uts", "--mount", "sh", "-c", _ENTER, "sh", self.hostname, str(self.hosts_file)]
        return ["ip", "netns", "exec", self.netns, *enter, *argv]

    def free_port(self) -> int:
        """A port free on this host's address a moment ago (asked inside the namespace)."""
        probe = f"import socket; s = socket.socket(); s.bind(({self.addr!r}, 0)); print(s.getsockname()[1])"
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(done.stdout)


def _create(a: Host, b: Host, created: list[str]) -> None:
    """Make both namespaces and the link, recording each namespace in ``created`` as it appears."""
    try:
        for host in (a, b):
            host.hosts_file.write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.hostname}\n")
            _ip("netns", "add", host.netns)
            created.append(host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
        # Made in a's namespace with the peer in b's: nothing ever sits in the caller's namespace.
        _ip(
            "-n", a.netns, "link", "add", f"{a.netns}v", "type", "veth", "peer", "name", f"{b.netns}v", "netns", b.netns
        )
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", f"{host.netns}v")
            _ip("-n", host.netns, "link", "set", f"{host.netns}v", "up")
    except RuntimeError as e:
        pytest.fail(f"cannot create the two test hosts (network namespaces on a veth pair): {e}")


def _delete(created: list[str]) -> None:
    errors = []
    for name in reversed(created):  # deleting a namespace deletes its end of the veth pair
        try:
            _ip("netns", "del", name)
        except RuntimeError as e:
            errors.append(str(e))
    if errors:
        raise RuntimeError("; ".join(errors))


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Create two namespaces on a veth pair; remove them (and so their links) on exit, even on error.

    Fails the test (never skips it) where namespaces cannot be made: CI runs as root.
    """
    if os.geteuid() != 0:
        pytest.fail("the two-host test needs root to create network namespaces (ip netns add); CI runs as root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.fail("the two-host test needs 'ip' (iproute2) and 'unshare' (util-linux): apt-get install iproute2")
    tag = secrets.token_hex(3)  # names unique among concurrent runs; veth names must stay <= 15 characters
    subnet = f"10.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}"
    created: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hyperpodrun-hosts-") as tmp:
        a, b = (
            Host(netns=f"hpr{tag}{x}", addr=f"{subnet}.{i}", hostname=f"hpr-host-{x}", hosts_file=Path(tmp) / x)
            for i, x in ((1, "a"), (2, "b"))
        )
        try:
            _create(a, b, created)
            yield a, b
        finally:
            _delete(created)
