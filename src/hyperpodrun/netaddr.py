"""This node's address as its peers see it."""

from __future__ import annotations

import socket


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers use to reach us), not the FQDN."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP connect sends nothing; it only selects the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
