"""The commit check: a training step is applied only if every collective it depends on completed.

On a GPU the host runs ahead of the device: ``loss.backward()`` returns while DDP's gradient
all-reduce (or FSDP2's reduce-scatter) is still queued or running, and ``optimizer.step()`` would
queue its kernels behind it. When a peer dies in that all-reduce and the round's communicators are
aborted, queued optimizer kernels would then run on partly reduced gradients: the survivors would
disagree, or one survivor would hand corrupted weights to its replacement, silently. (Measured on
an H100: ``optimizer.step()`` returned on the host 0.003 s into a step whose all-reduce waited 2 s
on the device.)

:class:`StepCommit` is called by the optimizer's pre-step hook, before anything of the step is
applied. It records a fence on the device's current stream (all the step's collectives are queued
before it), then waits, on the host and without blocking in a CUDA call, until the fence and every
tracked collective (:meth:`StepCommit.track`) completed, the round turns out broken (the
:mod:`.watchdog` aborted it), or the step's deadline passes (then it aborts the round itself).
Anything but completion raises :class:`~elastic_events.errors.StepAbandonedError`: the optimizer
step is not taken, the step changed nothing, and the training loop's ``recover()`` takes it from
there. The same rule as torchft's ``should_commit``, without a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from elastic_events.errors import StepAbandonedError

__all__ = ["DeviceFence", "StepCommit", "cuda_fence"]


class DeviceFence(Protocol):
    """Completes once everything queued on the device before it has run."""

    def query(self) -> bool: ...


def cuda_fence(device: torch.device) -> DeviceFence | None:
    """A CUDA event recorded now on ``device``'s current stream (None for a CPU device: nothing runs ahead)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


#: First and longest pause between two looks at the fence: short at first (a step's collectives usually
#: end within microseconds of the host's arrival here), longer later (a wait of seconds costs no CPU).
POLL_MIN_S = 50e-6
POLL_MAX_S = 2e-3


class StepCommit:
    """Whether the current step may be applied (see the module).

    Args:
        fence: makes a :class:`DeviceFence` of the work queued so far (None: nothing runs ahead of the host).
        broken: why the current round is broken, or None.
        deadline_s: how long a step's collectives may take to complete, at the time of the check.
        abort: ends the round's collectives (``abort(reason)``) when the deadline passes.
    """

    def __init__(
        self,
        *,
        fence: Callable[[], DeviceFence | None],
        broken: Callable[[], str | None],
        deadline_s: Callable[[], float],
        abort: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._fence, self._broken, self._deadline_s, self._abort = fence, broken, deadline_s, abort
        self._clock, self._sleep = clock, sleep
        self._works: list[Any] = []
        self.checks = 0  # steps checked
        self.waited_s = 0.0  # host time spent waiting for the device in checks

    def track(self, work: Any) -> None:
        """A collective's ``Work`` (``async_op=True``) the current step depends on."""
        self._works.append(work)

    def check(self, step: int) -> None:
        """Return if step ``step``'s collectives all completed; else raise :class:`StepAbandonedError`."""
        works, self._works = self._works, []
        self.checks += 1
        if (why := self._broken()) is not None:
            raise StepAbandonedError(step, why)
        fence = self._fence()
        start = now = self._clock()
        deadline = start + self._deadline_s()
        pause = POLL_MIN_S
        while not (all(w.is_completed() for w in works) and (fence is None or fence.query())):
            if (why := self._broken()) is not None:
                raise StepAbandonedError(step, why)
            if now >= deadline:
                why = f"its collectives did not complete within {deadline - start:.1f}s"
                self._abort(why)
                raise StepAbandonedError(step, why)
            self._sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
            now = self._clock()
        self.waited_s += now - start
        for w in works:
            error = w.exception()
            if error is not None:
                raise StepAbandonedError(step, f"a collective failed: {error}") from error
        if (why := self._broken()) is not None:  # aborted while the last collective ended
            raise StepAbandonedError(step, why)
