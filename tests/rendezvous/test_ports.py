"""The ports an agent advertises for rank 0's store are held until a round binds them (rendezvous/ports.py).

A port that was only free when the agent chose it could be handed to any other process before
rank 0 bound it: in CI a restarted round's rank 0 then failed with EADDRINUSE while a test in
the other lane ran. The first test runs in a network namespace whose ephemeral range is one
port wide, so the kernel has exactly one port to hand out and the question is decided, not
sampled.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hyperpodrun.rendezvous.elastic import ElasticRendezvous
from hyperpodrun.rendezvous.ports import PortReservation
from hyperpodrun.rendezvous.records import Keys, NodeRecord, decode
from hyperpodrun.rendezvous.static import StaticRendezvous
from hyperpodrun.store import create_store
from support.decider import one_node_context
from support.launch import clean_env

SRC = Path(__file__).resolve().parents[2] / "src"

# Run inside a fresh network namespace whose ephemeral ports are 40000 only.
ONE_PORT = textwrap.dedent(
    """
    import errno, json, socket
    from elastic_events.rounds.group import _listen_socket
    from hyperpodrun.rendezvous.ports import PortReservation

    def bind_any():
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
        except OSError as e:
            return errno.errorcode[e.errno]
        finally:
            s.close()

    def connect_out(port):
        try:
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
            return "connected"
        except OSError as e:
            return errno.errorcode[e.errno]

    out = {}
    listener = socket.socket()
    listener.bind(("127.0.0.2", 5000))
    listener.listen()
    held = PortReservation("127.0.0.1")
    out["held"] = held.port
    out["bind_any"] = bind_any()
    out["connect"] = connect_out(5000)
    store = _listen_socket("127.0.0.1", held.port)  # rank 0's listener for an in-place round
    out["store_port"] = store.getsockname()[1]
    store.close()
    held.release()
    out["bind_any_after_release"] = bind_any()
    print(json.dumps(out))
    """
)


def in_one_port_namespace(code: str) -> dict:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and 'unshare' (util-linux) for its network namespace")
    script = 'ip link set lo up && sysctl -qw net.ipv4.ip_local_port_range=\'40000 40000\' && exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(PYTHONPATH=str(SRC)),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_held_port_is_handed_to_no_other_socket_but_rank_zeros_store_binds_it() -> None:
    out = in_one_port_namespace(ONE_PORT)
    assert out["held"] == 40000  # the only ephemeral port
    assert out["bind_any"] == "EADDRINUSE"  # another program's bind(.., 0) is not given it
    assert out["connect"] == "EADDRNOTAVAIL"  # nor is an outgoing connection
    assert out["store_port"] == 40000  # rank 0's store still listens on it
    assert out["bind_any_after_release"] == 40000  # the control: free again once released


def plain_bind(host: str, port: int) -> int:
    """0 if a socket without SO_REUSEADDR can bind ``host:port`` (nobody holds it), else the errno."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno
    return 0


def test_the_agent_holds_the_port_in_its_record_until_the_next_one() -> None:
    store = create_store("c10d", "127.0.0.1:0", run_id="ports", conf={}, host=True, timeout=10.0)
    rdzv = ElasticRendezvous(store, context=one_node_context(), local_addr="127.0.0.1", join_timeout=60.0, node_id="a")

    def record_port() -> int:
        key = Keys.node("a")
        entry = store.get(key)
        record = decode(NodeRecord, key, entry.value if entry is not None else None)
        assert record is not None, "the agent wrote no node record"
        return record.port

    try:
        rdzv.join()
        first = record_port()
        rnd = rdzv.next_round(timeout=60.0)
        assert rnd.assignment.master_port == first
        assert plain_bind("127.0.0.1", first) == errno.EADDRINUSE  # held while the round may bind it
        rdzv.report_stopped(1, ok=False)  # the round ended: the record names a fresh port for the next
        second = record_port()
        assert second != first
        assert plain_bind("127.0.0.1", second) == errno.EADDRINUSE
        assert plain_bind("127.0.0.1", first) == 0  # the old one is let go
    finally:
        rdzv.shutdown(succeeded=False)
    assert plain_bind("127.0.0.1", second) == 0


def test_a_one_node_static_job_holds_each_rounds_port() -> None:
    rdzv = StaticRendezvous(nnodes=1, node_rank=0, nproc_per_node=1, master_addr="127.0.0.1", master_port=None)
    first = rdzv.next_round(timeout=1.0).assignment.master_port
    assert plain_bind("127.0.0.1", first) == errno.EADDRINUSE
    store = dist.TCPStore("127.0.0.1", first, 1, True, timedelta(seconds=10), wait_for_workers=False)
    assert store.port == first  # torch's TCPStore (rank 0 of a process-started round) binds it all the same
    del store
    second = rdzv.next_round(timeout=1.0).assignment.master_port
    assert second != first and plain_bind("127.0.0.1", second) == errno.EADDRINUSE
    rdzv.shutdown(succeeded=False)
    assert plain_bind("127.0.0.1", second) == 0


def test_a_reservation_is_released_once() -> None:
    with PortReservation("127.0.0.1") as held:
        assert held.held and plain_bind("127.0.0.1", held.port) == errno.EADDRINUSE
    assert not held.held
    held.release()
    assert plain_bind("127.0.0.1", held.port) == 0
