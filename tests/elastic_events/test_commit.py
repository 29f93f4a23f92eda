"""The commit check: a step whose collectives did not complete changes nothing.

Fakes stand in for the device (a fence that completes or never does) and for c10d's ``Work``
(completing, never completing, completing with an error); the optimizer and its parameters are real.
"""

from __future__ import annotations

import threading

import pytest
import torch

from elastic_events.errors import PeerFailureError, StepAbandonedError
from elastic_events.rounds.commit import StepCommit


class Fence:
    def __init__(self, done_after: int | None) -> None:
        self.done_after, self.queries = done_after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done_after is not None and self.queries > self.done_after


class Work:
    def __init__(self, *, completes: bool = True, error: Exception | None = None) -> None:
        self.completes, self.error = completes, error

    def is_completed(self) -> bool:
        return self.completes

    def exception(self) -> Exception | None:
        return self.error


class Clock:
    """Monotonic time that moves only when the check sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def commit(fence: Fence | None, *, broken=lambda: None, deadline_s: float = 1.0, aborts: list | None = None):
    clock = Clock()
    return StepCommit(
        fence=lambda: fence,
        broken=broken,
        deadline_s=lambda: deadline_s,
        abort=(aborts if aborts is not None else []).append,
        clock=clock,
        sleep=clock.sleep,
    ), clock


def trained(c: StepCommit) -> tuple[torch.nn.Linear, torch.Tensor, torch.optim.Optimizer]:
    """A model whose optimizer runs the commit check before every step, with a gradient ready."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: c.check(1))
    model(torch.randn(3, 4)).sum().backward()
    return model, torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()]), opt


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_step_whose_collectives_completed_is_applied() -> None:
    c, clock = commit(Fence(done_after=3))
    model, before, opt = trained(c)
    opt.step()
    assert not torch.equal(params(model), before)
    assert c.checks == 1 and 0 < c.waited_s < 0.01 and clock.now == c.waited_s


def test_a_step_whose_collective_never_completes_changes_nothing_and_aborts_the_round() -> None:
    aborts: list[str] = []
    c, clock = commit(Fence(done_after=None), deadline_s=2.0, aborts=aborts)
    model, before, opt = trained(c)
    with pytest.raises(StepAbandonedError, match="step 1 abandoned before its optimizer step: its collectives did not"):
        opt.step()
    assert torch.equal(params(model), before)
    assert opt.state == {}  # AdamW's state appears at its first step: none was taken
    assert aborts == ["its collectives did not complete within 2.0s"]
    assert 2.0 <= clock.now < 2.01


def test_a_round_found_broken_while_waiting_abandons_the_step_without_waiting_out_the_deadline() -> None:
    fence = Fence(done_after=None)
    c, clock = commit(fence, broken=lambda: "the launcher repairs round 3" if fence.queries >= 5 else None)
    model, before, opt = trained(c)
    with pytest.raises(StepAbandonedError, match="the launcher repairs round 3"):
        opt.step()
    assert torch.equal(params(model), before) and clock.now < 0.01


@pytest.mark.parametrize(
    "work",
    [Work(completes=False), Work(error=RuntimeError("NCCL error: remote process exited"))],
    ids=["never-completes", "completes-with-an-error"],
)
def test_a_tracked_collective_that_fails_or_never_completes_abandons_the_step(work: Work) -> None:
    c, _ = commit(None, deadline_s=0.5)
    model, before, opt = trained(c)
    c.track(work)
    with pytest.raises(StepAbandonedError) as raised:
        opt.step()
    assert isinstance(raised.value, PeerFailureError)  # recover() takes it up as a peer's failure
    assert torch.equal(params(model), before)


def test_a_step_is_abandoned_when_its_round_was_already_broken() -> None:
    c, clock = commit(Fence(done_after=0), broken=lambda: "aborted")
    model, before, opt = trained(c)
    with pytest.raises(StepAbandonedError, match="aborted"):
        opt.step()
    assert torch.equal(params(model), before) and clock.now == 0.0


def test_the_wait_polls_gently_and_ends_when_another_thread_completes_the_work() -> None:
    """A real clock: the check waits for a collective another thread completes, without a CUDA call."""
    work = Work(completes=False)
    c = StepCommit(fence=lambda: None, broken=lambda: None, deadline_s=lambda: 10.0, abort=lambda why: None)
    c.track(work)
    timer = threading.Timer(0.05, lambda: setattr(work, "completes", True))
    timer.start()
    c.check(1)
    timer.join()
    assert 0.04 < c.waited_s < 1.0
