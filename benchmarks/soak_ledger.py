"""The soak's bookkeeping, pure functions of logs: which steps were trained, redone, and on what samples.

Inputs are the example trainer's logs: the sample log (``--sample-log``: one record per rank per
optimizer step, ``{step, rank, world_size, epoch, position, sample_ids}``, appended in the order
the ranks finished the steps) and the launchers' event log (``checkpoint_saved`` records carry
the committed step). Nothing here starts processes or reads the clock, so every rule is
unit-testable.

* An **attempt** of a step is one training of it by the ranks of one world: a record for a
  ``(step, rank)`` already in the step's current attempt, or of another world size, starts a new
  attempt. The last attempt is the one whose update the job kept; earlier ones were redone
  (a failure rolled the job back to its last checkpoint).
* A step's kept attempt must train exactly the step's global batch of the epoch permutation:
  what it lacks is **lost**, what it has twice or too many is **repeated**.
* A **redone** step is trained again after an event. Graceful events (join, leave, yield, uncap,
  store restart or pause) may redo nothing; failures may redo only steps after the last checkpoint
  committed before the failure.
* An **unlogged** step is a kept attempt that lacks some ranks' records although the job went on
  past it, and whose records hold exactly their ranks' share of the batch. A rank killed or stopped
  after the step's all-reduce but before its record does that: its peers' records prove the
  all-reduce ran, and it needs every rank's gradients, so the step trained its whole batch. Only
  a failure may leave one; after a graceful event it is a problem.
* An attempt belongs to the window of the last event injected before its first record, except an
  unlogged one: it belongs where the job went past it (the next first record of a later step).
  Its missing rank was lost after its peers had logged the step, so the event that cost the
  record can come after the attempt's first line.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "FAILURE_KINDS",
    "GRACEFUL_KINDS",
    "KINDS",
    "Attempt",
    "WindowCheck",
    "attempts_of",
    "batch_problems",
    "check_window",
    "committed_step",
    "goodput",
    "missing_steps",
    "unlogged_problem",
    "unlogged_ranks",
]

GRACEFUL_KINDS = ("join", "leave", "yield", "uncap", "etcd_restart", "etcd_pause")
FAILURE_KINDS = ("kill_rank", "kill_node", "stop_rank")
KINDS = GRACEFUL_KINDS + FAILURE_KINDS


@dataclasses.dataclass(kw_only=True)
class Attempt:
    """One training of ``step`` by a world of ``world_size`` ranks; ``line`` is its first record's index."""

    step: int
    world_size: int
    line: int
    ids_by_rank: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    #: The first line after ``line`` that starts an attempt of a later step: where the job went past this one.
    passed_line: int | None = None

    @property
    def complete(self) -> bool:
        return sorted(self.ids_by_rank) == list(range(self.world_size))

    def sample_ids(self) -> list[int]:
        return [i for rank in sorted(self.ids_by_rank) for i in self.ids_by_rank[rank]]


def attempts_of(records: Iterable[dict[str, Any]]) -> dict[int, list[Attempt]]:
    """Every step's attempts in log order (see the module docstring)."""
    by_step: dict[int, list[Attempt]] = {}
    for line, rec in enumerate(records):
        step, rank, world = int(rec["step"]), int(rec["rank"]), int(rec["world_size"])
        tries = by_step.setdefault(step, [])
        current = tries[-1] if tries else None
        if current is None or rank in current.ids_by_rank or current.world_size != world:
            current = Attempt(step=step, world_size=world, line=line)
            tries.append(current)
        current.ids_by_rank[rank] = list(rec["sample_ids"])
    starts = sorted((a.line, a.step) for tries in by_step.values() for a in tries)
    for tries in by_step.values():
        for attempt in tries:
            first_after = bisect.bisect_right(starts, (attempt.line, 1 << 62))
            later = (starts[i] for i in range(first_after, len(starts)))
            attempt.passed_line = next((line for line, step in later if step > attempt.step), None)
    return by_step


def batch_problems(attempt: Attempt, expected: Sequence[int]) -> tuple[int, int, str | None]:
    """(samples lost, samples repeated, a one-line problem or None) of a kept attempt against its batch."""
    got, want = Counter(attempt.sample_ids()), Counter(expected)
    lost = sum((want - got).values())
    repeated = sum((got - want).values())
    problem = None
    if not attempt.complete:
        problem = (
            f"step {attempt.step}: logged by ranks {sorted(attempt.ids_by_rank)} of a world of {attempt.world_size}"
        )
    elif lost or repeated:
        problem = f"step {attempt.step}: {lost} sample(s) of its batch missing, {repeated} extra or twice"
    return lost, repeated, problem


def committed_step(events: Iterable[dict[str, Any]], before_ts: float) -> int:
    """The newest checkpoint step saved before ``before_ts`` (0: none yet), from the event log."""
    steps = [int(e["step"]) for e in events if e.get("event") == "checkpoint_saved" and e["ts"] <= before_ts]
    return max(steps, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowCheck:
    """What the sample log says about one event's window (from its injection to the next event's)."""

    steps_trained: int  # distinct steps with a record in the window
    steps_redone: tuple[int, ...]  # steps trained again in the window (after an earlier attempt)
    committed_step: int  # newest checkpoint before the event
    redone_committed: tuple[int, ...]  # redone steps at or before ``committed_step``: never allowed
    steps_unlogged: tuple[int, ...]  # kept attempts without some ranks' records, the job past them
    samples_redone: int  # sample trainings of the redone attempts
    samples_lost: int  # in kept attempts started in the window, against their batches
    samples_repeated: int
    problems: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "steps_redone": list(self.steps_redone),
            "redone_committed": list(self.redone_committed),
            "steps_unlogged": list(self.steps_unlogged),
            "problems": list(self.problems),
        }


def check_window(
    by_step: dict[int, list[Attempt]],
    *,
    first_line: int,
    end_line: int,
    graceful: bool,
    committed: int,
    expected: Callable[[int], Sequence[int]],
) -> WindowCheck:
    """Check the attempts that started in sample-log lines ``[first_line, end_line)``.

    Graceful events may redo nothing; failures may redo only steps after ``committed``. Every
    kept attempt started in the window that is complete must hold exactly its step's batch. An
    incomplete one the job went past in the window is unlogged (see the module docstring): allowed
    after a failure, a problem after a graceful event; at the log's end it is a step still being logged.
    """
    redone: list[int] = []
    unlogged: list[int] = []
    last_step = max(by_step, default=0)
    samples_redone = lost = repeated = 0
    trained: set[int] = set()
    problems: list[str] = []
    for step, tries in by_step.items():
        for index, attempt in enumerate(tries):
            unlogged_at = attempt.passed_line if index == len(tries) - 1 and not attempt.complete else None
            if not first_line <= (attempt.line if unlogged_at is None else unlogged_at) < end_line:
                continue
            trained.add(step)
            if index > 0:
                redone.append(step)
                samples_redone += len(attempt.sample_ids())
            if index == len(tries) - 1 and attempt.complete:
                lost_here, repeated_here, problem = batch_problems(attempt, expected(step))
                lost, repeated = lost + lost_here, repeated + repeated_here
                if problem:
                    problems.append(problem)
            elif index == len(tries) - 1 and step < last_step:
                unlogged.append(step)
                problem = unlogged_problem(attempt, expected(step))
                if problem or graceful:
                    problems.append(
                        problem
                        or f"step {attempt.step}: {unlogged_ranks(attempt)} left no record after a graceful event"
                    )
    redone = sorted(set(redone))
    bad = tuple(s for s in redone if s <= committed)
    if graceful and redone:
        problems.append(f"a graceful event redid steps {redone[:10]}")
    if bad:
        problems.append(f"steps {list(bad[:10])} were redone although checkpoint {committed} had committed them")
    return WindowCheck(
        steps_trained=len(trained),
        steps_redone=tuple(redone),
        committed_step=committed,
        redone_committed=bad,
        steps_unlogged=tuple(sorted(unlogged)),
        samples_redone=samples_redone,
        samples_lost=lost,
        samples_repeated=repeated,
        problems=tuple(problems),
    )


def unlogged_ranks(attempt: Attempt) -> str:
    """``rank(s) [..] of a world of N``: the ranks whose records an attempt lacks."""
    return f"rank(s) {sorted(set(range(attempt.world_size)) - set(attempt.ids_by_rank))} of a world of {attempt.world_size}"


def unlogged_problem(attempt: Attempt, expected: Sequence[int]) -> str | None:
    """Why an incomplete attempt cannot be a full step whose missing ranks died before their records
    (None: it can): the present records must be distinct samples of the batch, an even share each,
    and leave out exactly the missing ranks' shares."""
    ids, share = attempt.sample_ids(), len(expected) // attempt.world_size
    missing = attempt.world_size - len(attempt.ids_by_rank)
    if (
        len(set(ids)) != len(ids)
        or not set(ids) <= set(expected)
        or len(expected) % attempt.world_size
        or any(len(v) != share for v in attempt.ids_by_rank.values())
        or len(expected) - len(ids) != missing * share
    ):
        return f"step {attempt.step}: {unlogged_ranks(attempt)} left no record, and the others' samples are not their share of the batch"
    return None


def missing_steps(by_step: dict[int, list[Attempt]], steps: int) -> list[int]:
    """Steps 1..``steps`` without a complete kept attempt (trained by no full world)."""
    return [s for s in range(1, steps + 1) if s not in by_step or not by_step[s][-1].complete]


def goodput(baseline_s: float, with_events_s: float) -> float:
    """Time to reach the step target without events over the time with them (1.0: events cost nothing)."""
    if not baseline_s > 0 or not with_events_s > 0:
        raise ValueError(f"times must be > 0, got {baseline_s!r} and {with_events_s!r}")
    return baseline_s / with_events_s
