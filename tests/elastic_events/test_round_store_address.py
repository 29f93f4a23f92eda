"""The per-round store of an in-process round listens on the master address only. Failed on the
code that fell back to all interfaces when binding the master address failed."""

from __future__ import annotations

import pytest

from elastic_events.errors import GroupError
from elastic_events.rounds.group import _listen_socket
from support.ports import free_port


def test_the_round_store_never_falls_back_to_all_interfaces() -> None:
    with pytest.raises(GroupError, match=r"rank 0 cannot listen on 203\.0\.113\.5:\d+"):
        _listen_socket("203.0.113.5", free_port())  # not an address of this machine


def test_the_round_store_listens_on_the_master_address() -> None:
    sock = _listen_socket("127.0.0.1", free_port())
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
