"""Free ports for the tests' own servers (never a hard-coded one).

A port handed out here stays reserved (:class:`~hyperpodrun.rendezvous.ports.PortReservation`)
until the test process exits, so no other test's ``bind(.., 0)``, no agent's port and no
outgoing connection can be given it while the server it was meant for starts. The servers the
tests start (etcd, Slurm's daemons, the embedded store, torch's ``TCPStore``, the metrics
endpoint) bind with ``SO_REUSEADDR``, which a reservation allows.
"""

from __future__ import annotations

from hyperpodrun.rendezvous.ports import PortReservation

# Every port this test process handed out, held until it exits (a few sockets per test).
_HELD: list[PortReservation] = []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing but the caller's server will bind while this process lives."""
    held = PortReservation(host)
    _HELD.append(held)
    return held.port
