"""This node on the network: its address on the route to the store, and the interface gloo uses.

By default gloo binds to, and advertises to its peers, the address its machine's hostname
resolves to, falling back to 127.0.0.1 when that address cannot be bound. Where the hostname
resolves to a loopback address (many containers; Debian's ``127.0.1.1`` entry) every rank
advertises a loopback address and ``connectFullMesh`` fails as soon as a job spans two machines.
The agent already knows the address other nodes reach it at (its address on the route to the
store), so unless the user chose an interface, it gives its ranks ``GLOO_SOCKET_IFNAME`` for the
interface that carries that address. NCCL's interface choice is left alone: it does not use the
hostname, and ``NCCL_SOCKET_IFNAME`` stays the user's.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import psutil

__all__ = ["GLOO_SOCKET_IFNAME", "GlooInterface", "choose_gloo_interface", "interface_of"]

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class _InterfaceAddress(Protocol):  # psutil's snicaddr
    family: int
    address: str


@dataclass(frozen=True, kw_only=True)
class GlooInterface:
    """The outcome of :func:`choose_gloo_interface`.

    ``env`` holds what the agent adds to every rank's environment (empty when it leaves the
    choice to the user or to gloo); ``message`` is the agent's start-up line about it, or
    empty when there is nothing worth saying (a one-host job on loopback).
    """

    env: Mapping[str, str] = field(default_factory=dict)
    message: str = ""


def _ip(text: str) -> _IPAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # psutil writes link-local v6 as fe80::1%eth0
    except ValueError:
        return None


def _resolve(addr: str) -> _IPAddress | None:
    """``addr`` as an IP address; a host name (``--local-addr`` may be one) is resolved."""
    ip = _ip(addr)
    if ip is not None:
        return ip
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    return _ip(str(infos[0][4][0])) if infos else None


def interface_of(address: str, interfaces: Mapping[str, Sequence[_InterfaceAddress]] | None = None) -> str | None:
    """The name of the interface that carries ``address`` (an IP literal), or None.

    ``interfaces`` maps names to their addresses as :func:`psutil.net_if_addrs` does (the
    default: this machine's). When several carry it, the first in that mapping wins.
    """
    wanted = _ip(address)
    if wanted is None:
        return None
    if interfaces is None:
        interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and _ip(a.address) == wanted:
                return name
    return None


def choose_gloo_interface(
    local_addr: str,
    environ: Mapping[str, str],
    interfaces: Mapping[str, Sequence[_InterfaceAddress]] | None = None,
) -> GlooInterface:
    """What the ranks of a node reachable at ``local_addr`` get for ``GLOO_SOCKET_IFNAME``.

    The user's own ``GLOO_SOCKET_IFNAME`` (in ``environ``) always wins and is left as it is.
    A loopback ``local_addr`` means every node is on this machine, where gloo's default works:
    nothing is set, so a one-host job sees exactly torchrun's environment.
    """
    if environ.get(GLOO_SOCKET_IFNAME):
        return GlooInterface()
    ip = _resolve(local_addr)
    if ip is not None and ip.is_loopback:
        return GlooInterface()
    name = interface_of(str(ip), interfaces) if ip is not None else None
    if name is None:
        return GlooInterface(
            message=f"no network interface here carries this node's address {local_addr}; gloo picks its "
            f"own, which fails across machines if the hostname resolves to loopback: set {GLOO_SOCKET_IFNAME}"
        )
    return GlooInterface(
        env={GLOO_SOCKET_IFNAME: name},
        message=f"ranks use {GLOO_SOCKET_IFNAME}={name}, the interface of this node's address {local_addr} "
        f"on the route to the store (set {GLOO_SOCKET_IFNAME} to choose another)",
    )


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers use to reach us), not the FQDN."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP connect sends nothing; it only selects the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
