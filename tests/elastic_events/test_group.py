"""Forming a round's group: a rank that arrives before new rank 0 hosts the store."""

from __future__ import annotations

import socket
import threading

import pytest

from elastic_events.errors import GroupError
from elastic_events.rounds.group import wait_for_listener


@pytest.fixture
def bound():
    """A port of ours that refuses connections until the test calls ``listen()``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


def test_an_early_rank_connects_as_soon_as_rank_0_listens(bound) -> None:
    """c10d's client backs off exponentially: an early joiner connected about as late again as it
    had waited; the wait returns at the first connect that succeeds."""
    accepted = threading.Event()

    def listen_later() -> None:
        bound.listen(1)
        bound.accept()[0].close()
        accepted.set()

    timer = threading.Timer(0.3, listen_later)
    timer.start()
    try:
        wait_for_listener("127.0.0.1", bound.getsockname()[1], timeout_s=30)
        assert accepted.wait(timeout=30)
    finally:
        timer.join()


def test_nothing_listening_fails_with_the_address_and_the_limit(bound) -> None:
    port = bound.getsockname()[1]
    with pytest.raises(GroupError, match=rf"nothing listens on 127\.0\.0\.1:{port} for the new round's store after 0s"):
        wait_for_listener("127.0.0.1", port, timeout_s=0.2)
