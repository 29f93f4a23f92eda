"""How often a sharded model's in-memory snapshot is taken when the interval is ``auto``.

A snapshot streams the rank's shards to its holder while the next step's forward and backward run;
the next optimizer step waits for what is not sent yet. What a snapshot costs the job is that step's
extra time: the wait, and whatever the streaming takes from the step beside it (host cores, memory
and network bandwidth it shares with the step and the data loaders). What it buys is a rollback of
at most one interval after a failure. ``auto`` (the default) measures both sides once per round and
picks the smallest interval whose cost stays under a target share of the step time:

    every = ceil(cost / (target * step))            (the cost rule)

and, where the job's mean time between failures is known, Young's interval when it is longer: the
one that minimises the snapshots' cost plus the expected work a failure redoes
(``sqrt(2 * cost * mtbf)``, J. W. Young, CACM 1974; Daly 2006 refines it for costs near the MTBF):

    every = max(cost rule, round(sqrt(2 * cost * mtbf) / step))

The measurement (:class:`Calibration`): after the round's first snapshot (taken at once, as always)
and its first step, the round snapshots every other step until it has timed
:data:`CALIBRATION_STEPS` steps that carry a snapshot and as many that do not. A snapshot's cost is
the fastest step with one less the fastest step without (the fastest: a step is only ever slowed by
what runs beside it); the ranks agree on the largest cost and the smallest step (every rank must
snapshot the same steps). A choice is made per round: the world size, and so each rank's share of
the state, changes with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["CALIBRATION_STEPS", "Calibration", "IntervalChoice", "choose_interval"]

CALIBRATION_STEPS = 2  # steps timed per round with a snapshot beside them, and as many without


@dataclass(frozen=True, kw_only=True)
class IntervalChoice:
    """The interval ``auto`` chose, and what it was chosen from."""

    every: int  # steps between snapshots: a failure redoes at most this many
    cost_s: float  # the step time a snapshot costs (the wait for it, and what it takes from the step beside it)
    step_s: float  # a step without a snapshot beside it
    target: float  # the share of step time snapshots may cost
    mtbf_s: float | None  # the job's mean time between failures, where known
    rule: Literal["cost", "young"]  # which bound decided

    @property
    def overhead(self) -> float:
        """The share of step time the snapshots cost at this interval."""
        return self.cost_s / (self.every * self.step_s) if self.step_s > 0 else 0.0

    def describe(self) -> str:
        why = (
            f"Young's interval for a failure every {self.mtbf_s:.0f} s"
            if self.rule == "young"
            else f"target {self.target:.1%}"
        )
        return (
            f"snapshot every {self.every} step(s): {self.cost_s * 1e3:.1f} ms per snapshot, step "
            f"{self.step_s * 1e3:.1f} ms, overhead {self.overhead:.2%} ({why}); a failure redoes at most "
            f"{self.every} step(s)"
        )


def choose_interval(*, cost_s: float, step_s: float, target: float, mtbf_s: float | None = None) -> IntervalChoice:
    """The smallest interval whose snapshots cost at most ``target`` of the step time, or Young's
    interval for ``mtbf_s`` where that is longer. Pure: the same inputs give the same choice."""
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target!r}")
    if mtbf_s is not None and not mtbf_s > 0:
        raise ValueError(f"mtbf_s must be > 0 or None, got {mtbf_s!r}")
    cost_s, step_s = max(0.0, cost_s), max(0.0, step_s)
    if step_s == 0.0:
        every = 1 if cost_s == 0.0 else 1_000_000  # no step time to hide it in: as rare as can be
    else:
        every = max(1, math.ceil(cost_s / (target * step_s) - 1e-9))
    rule: Literal["cost", "young"] = "cost"
    if mtbf_s is not None and step_s > 0 and cost_s > 0:
        young = round(math.sqrt(2.0 * cost_s * mtbf_s) / step_s)
        if young > every:
            every, rule = young, "young"
    return IntervalChoice(every=every, cost_s=cost_s, step_s=step_s, target=target, mtbf_s=mtbf_s, rule=rule)


@dataclass
class Calibration:
    """One round's measurement for ``auto``: the durations of the steps that carried a snapshot (its
    streaming beside them, the optimizer step's wait for it) and of those that did not."""

    carried: list[float]
    plain: list[float]

    @classmethod
    def empty(cls) -> Calibration:
        return cls(carried=[], plain=[])

    def add(self, step_s: float, *, carried: bool) -> None:
        (self.carried if carried else self.plain).append(step_s)

    @property
    def done(self) -> bool:
        return len(self.carried) >= CALIBRATION_STEPS and len(self.plain) >= CALIBRATION_STEPS

    def report(self) -> tuple[float, float]:
        """This rank's part of the decision: what a snapshot costs a step, and a step without one."""
        plain = min(self.plain)
        return max(0.0, min(self.carried) - plain), plain
