"""How the job ends for a node once the store has been gone for outage_timeout: a pure function of the
ranks' state, decided once (the ranks asked to save are not stopped by a second decision)."""

from __future__ import annotations

import pytest

from hyperpodrun.outage import SAVE_MARGIN_STEPS, StoreOutage, final_directive
from hyperpodrun.rendezvous import DirectiveKind, LocalStatus
from hyperpodrun.supervisor import WorkerState


def status(state: WorkerState, steps=(40, 41), failure: str | None = None) -> LocalStatus:
    return LocalStatus(group_state=state, steps=steps, step_times=(0.1, 0.1), failure=failure)


def test_an_outage_becomes_final_once_after_its_limit_on_the_local_clock() -> None:
    now = [100.0]
    outage = StoreOutage(limit=60.0, clock=lambda: now[0])
    assert outage.failed() and not outage.failed()  # the first failure starts it, once
    now[0] = 159.0
    assert not outage.conclude()
    now[0] = 160.0
    assert outage.conclude() and not outage.conclude()  # decided once
    assert outage.recovered() == pytest.approx(60.0) and outage.recovered() is None


@pytest.mark.parametrize(
    ("state", "pending", "steps", "kind", "code"),
    [
        (WorkerState.SUCCEEDED, False, (9, 9), DirectiveKind.EXIT, 0),  # done here; the outcome elsewhere unknown
        (WorkerState.FAILED, False, (9, 9), DirectiveKind.EXIT, 1),
        (WorkerState.HEALTHY, False, (40, 41), DirectiveKind.SAVE_AND_EXIT, 0),
        (WorkerState.HEALTHY, True, (40, 41), DirectiveKind.STOP, 0),  # an event in flight: no second one
        (WorkerState.HEALTHY, False, (0, 0), DirectiveKind.STOP, 0),  # ranks that never step cannot save
    ],
)
def test_what_ends_the_job_when_the_store_is_gone(state, pending, steps, kind, code) -> None:
    failure = "rank 1 exited with code 3" if state == WorkerState.FAILED else None
    directive = final_directive(
        status(state, steps, failure), pending=pending, acked_events=[4, 5], limit=60.0, error="connection refused"
    )
    assert (directive.kind, directive.exit_code) == (kind, code)
    assert "unreachable for 60s (--rdzv-conf outage_timeout): connection refused" in directive.reason
    if kind is DirectiveKind.SAVE_AND_EXIT:
        assert (directive.event_id, directive.target_step) == (6, 41 + SAVE_MARGIN_STEPS)
    if failure:
        assert directive.reason.startswith(failure)
