"""Which hung ranks are killed where failures are repaired in place: a pure function of idle times and process states."""

from __future__ import annotations

import pytest

from hyperpodrun.hang import culprits


@pytest.mark.parametrize(
    ("states", "idle", "expected"),
    [
        ({0: "sleeping", 1: "stopped"}, {0: 3.0, 1: 3.0}, (1,)),  # the SIGSTOPped rank, not the one waiting for it
        ({0: "sleeping", 1: "disk-sleep"}, {0: 9.0, 1: 3.0}, (1,)),  # stuck in I/O
        ({0: "sleeping", 1: "sleeping"}, {0: 3.0, 1: 3.0}, ()),  # both waiting: give the culprit's own agent a limit
        ({0: "sleeping", 1: "sleeping"}, {0: 5.0, 1: 3.0}, (0,)),  # waited a second limit: a deadlock of its own
    ],
)
def test_culprits_spare_ranks_that_only_wait_for_a_peer(states: dict[int, str], idle: dict[int, float], expected: tuple[int, ...]) -> None:
    assert culprits((0, 1), idle=idle, states=states, limit=2.0) == expected
