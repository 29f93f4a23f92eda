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
def test_culprits_spare_ranks_that_only_wait_for_a_peer(
    states: dict[int, str], idle: dict[int, float], expected: tuple[int, ...]
) -> None:
    assert culprits((0, 1), idle=idle, states=states, limit=2.0) == expected


def test_a_rank_still_in_the_broken_round_after_the_grace_is_replaced() -> None:
    """With three nodes a survivor now and then stayed blocked in the broken group's collective (it never
    saw its peers leave) until the repair timed out after 60 s and the job fell back to a restart."""
    from elastic_events.control import RankPhase, RankProgress
    from hyperpodrun.repair import STUCK_GRACE_MIN_S, stuck_in_broken_group

    progress = [
        RankProgress(
            step=40, time=0.0, acked_event=0, phase=RankPhase.RUNNING, round=3
        ),  # blocked in round 3's collective
        RankProgress(step=40, time=0.0, acked_event=0, phase=RankPhase.RECOVERING, round=3),  # saw the failure
        RankProgress(step=40, time=0.0, acked_event=7, phase=RankPhase.READY, round=4),  # in the repaired round
        RankProgress(step=0, time=0.0, acked_event=0, phase=RankPhase.PARKED, round=0),  # the dead rank's replacement
        # found by CI: a rank that had moved rounds in place before (an earlier repair) trains as READY
        RankProgress(step=40, time=0.0, acked_event=5, phase=RankPhase.READY, round=3),
    ]
    assert stuck_in_broken_group(progress, next_round=4, waited=STUCK_GRACE_MIN_S - 0.1, slowest_step_s=0.01) == []
    assert stuck_in_broken_group(progress, next_round=4, waited=STUCK_GRACE_MIN_S + 0.1, slowest_step_s=0.01) == [0, 4]
    assert (
        stuck_in_broken_group(progress, next_round=4, waited=STUCK_GRACE_MIN_S + 0.1, slowest_step_s=1.0) == []
    )  # 4 slow steps


def test_a_blocked_rank_that_hands_its_state_off_is_replaced_at_once_and_one_writing_it_is_waited_for() -> None:
    from elastic_events.control import SNAPSHOT_WRITING, RankPhase, RankProgress
    from hyperpodrun.repair import HANDOFF_WRITE_S, STUCK_GRACE_MIN_S, stuck_in_broken_group

    progress = [
        RankProgress(
            step=40, time=0.0, acked_event=0, phase=RankPhase.RUNNING, round=3, snapshot_step=40
        ),  # handed off
        RankProgress(
            step=40, time=0.0, acked_event=0, phase=RankPhase.RUNNING, round=3, snapshot_step=SNAPSHOT_WRITING
        ),
        RankProgress(
            step=40, time=0.0, acked_event=0, phase=RankPhase.RECOVERING, round=3, snapshot_step=40
        ),  # recovering after all
    ]
    assert stuck_in_broken_group(progress, next_round=4, waited=0.6, slowest_step_s=0.01) == [0]
    assert stuck_in_broken_group(progress, next_round=4, waited=STUCK_GRACE_MIN_S + 1, slowest_step_s=0.01) == [0]
    late = STUCK_GRACE_MIN_S + HANDOFF_WRITE_S + 0.1
    assert stuck_in_broken_group(progress, next_round=4, waited=late, slowest_step_s=0.01) == [0, 1]


@pytest.mark.parametrize(
    ("repairing", "peer_failed", "pending", "fast"),
    [
        (True, False, False, True),  # a local rank was replaced: the repair event is being made
        (False, True, False, True),  # local ranks wait in recover() for it
        (True, True, True, False),  # published to the ranks: the rest is bookkeeping
        (False, False, False, False),  # nothing in flight: the usual tick
    ],
)
def test_an_agent_reads_the_store_fast_only_while_a_failure_waits_for_its_repair(
    repairing, peer_failed, pending, fast
) -> None:
    """The crash repairs of the failures benchmark spent 0.4 s, two ticks, between the decision and the survivors' signal."""
    from hyperpodrun.repair import URGENT_POLL_S, poll_interval

    interval = poll_interval(repairing=repairing, peer_failed=peer_failed, pending=pending, tick=0.2)
    assert interval == (URGENT_POLL_S if fast else 0.2)
