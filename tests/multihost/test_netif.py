"""Choosing GLOO_SOCKET_IFNAME from the node's address (hyperpodrun.netif), on given interface tables."""

from __future__ import annotations

import socket
from typing import NamedTuple

import pytest

from hyperpodrun.netif import GLOO_SOCKET_IFNAME, choose_gloo_interface, interface_of


class Addr(NamedTuple):  # the fields of psutil's snicaddr that matter here
    family: int
    address: str


TABLE = {
    "lo": [Addr(socket.AF_INET, "127.0.0.1"), Addr(socket.AF_INET6, "::1")],
    "eth0": [Addr(socket.AF_PACKET, "02:fc:00:00:00:01"), Addr(socket.AF_INET, "10.0.0.5")],
    "ib0": [
        Addr(socket.AF_INET, "192.168.7.2"),
        Addr(socket.AF_INET6, "fe80::1%ib0"),
        Addr(socket.AF_INET6, "fd00::7"),
    ],
}


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.5", "eth0"),
        ("192.168.7.2", "ib0"),
        ("fd00::7", "ib0"),
        ("fe80::1", "ib0"),  # psutil's scoped link-local form matches the bare address
        ("127.0.0.1", "lo"),
        ("10.0.0.6", None),
        ("02:fc:00:00:00:01", None),  # a MAC address is not an IP address of any interface
        ("not-an-address", None),
    ],
)
def test_interface_of(address: str, expected: str | None) -> None:
    assert interface_of(address, TABLE) == expected


def test_interface_of_reads_this_machine_by_default() -> None:
    assert interface_of("127.0.0.1") is not None  # every Linux machine has a loopback interface


def test_agent_sets_the_interface_of_its_address_and_says_so() -> None:
    choice = choose_gloo_interface("192.168.7.2", {}, TABLE)
    assert dict(choice.env) == {GLOO_SOCKET_IFNAME: "ib0"}
    assert "GLOO_SOCKET_IFNAME=ib0" in choice.message and "192.168.7.2" in choice.message


@pytest.mark.parametrize(
    ("local_addr", "environ"),
    [
        ("192.168.7.2", {GLOO_SOCKET_IFNAME: "eth0"}),  # the user's choice stands, silently
        ("127.0.0.1", {}),  # one host: gloo's default works, torchrun's environment is kept
        ("::1", {}),
        ("localhost", {}),  # a name is resolved before the loopback check
    ],
)
def test_agent_leaves_gloo_alone(local_addr: str, environ: dict[str, str]) -> None:
    choice = choose_gloo_interface(local_addr, environ, TABLE)
    assert (dict(choice.env), choice.message) == ({}, "")


def test_unknown_address_sets_nothing_and_tells_the_user_what_to_set() -> None:
    choice = choose_gloo_interface("10.9.9.9", {}, TABLE)  # e.g. --local-addr names a NAT address
    assert dict(choice.env) == {}
    assert "10.9.9.9" in choice.message and f"set {GLOO_SOCKET_IFNAME}" in choice.message
