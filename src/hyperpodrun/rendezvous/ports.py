"""Ports a node advertises for a later round's store, held from the moment they are chosen.

An agent names rank 0's store port (``MASTER_PORT``) in its node record or its ack, seconds
before a rank binds it. A port that was merely free when it was chosen (torchrun's way) can
be taken in between: any process's ``bind(host, 0)`` or outgoing connection may be handed the
same number, and rank 0 then fails with ``EADDRINUSE`` (or its peers reach a stranger's
socket). A :class:`PortReservation` keeps the port bound, with ``SO_REUSEADDR`` and never
listening, for as long as the agent may still publish it. On Linux such a socket:

- keeps the port out of every other ``bind(.., 0)`` and every outgoing connection's
  ephemeral choice, which only take ports with no bound socket;
- does not stop rank 0's store from binding and listening on it: the round's own listener
  (:func:`elastic_events.rounds.group.init_round_group`) and torch's ``TCPStore`` both set
  ``SO_REUSEADDR``, and two such sockets share a port while at most one listens.
"""

from __future__ import annotations

import socket

__all__ = ["PortReservation", "reserve_anew"]


class PortReservation:
    """A TCP port on ``host`` that nothing else on the machine is handed while this object holds it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port: int = self._sock.getsockname()[1]

    @property
    def held(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        """Let the port go (idempotent); a store already listening on it keeps listening."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PortReservation({self.host}:{self.port}, held={self.held})"


def reserve_anew(previous: PortReservation | None, host: str) -> PortReservation:
    """A new port held on ``host``, then ``previous`` let go: the round that could use it is over."""
    held = PortReservation(host)
    if previous is not None:
        previous.release()
    return held
