"""Catching a joiner up from a consistent copy of step ``s`` to the survivors' step ``t`` without a second copy.

A join that heals in the background sends the joiner a copy of the state at step ``s`` while the
survivors go on training to ``t = s + k``. What changed in those ``k`` steps is, for a replicated model,
exactly what each optimizer step applied: the averaged gradient of every parameter and the
hyperparameters of its group at that step (a scheduler's learning rate, for one). Given those, the joiner's
own optimizer, stepped over its copy, reaches the survivors' state at ``t`` bit for bit: the same inputs
through the same kernels. Each step's record is one gradient per parameter, so an Adam rank (parameters
plus two moments) catches up on a third of its state per step, and the records are sent while they are
made, not while the survivors wait.

- :class:`DeltaLog` records, on a source rank, what each optimizer step applies (an optimizer pre-step
  hook: after clipping and the commit check, before anything changes), from a given step on and up to a
  bound, past which it stops and says so: the joiner then takes a full copy, as today.
- :func:`replay` applies the records to the joiner's optimizer, refusing a gap, a missing step or a
  parameter of another shape.
- :func:`plan_entry` is the decision: the step at which the joiner enters, from the copy's time and the
  step time, or a full copy where the records would not fit their bound.

The small state (the step, the sampler, the scheduler's counters, RNG) is not replayed: it is taken
from the source at entry, as in every hydration. A sharded model's gradient is a shard, so these
records serve a rank's own shard index (HSDP: one replica's rank ``i`` for another's rank ``i``).

A log registered after the round's commit check (:mod:`.commit`, itself a pre-step hook) records only
steps whose collectives completed. These parts are not the join path yet: on a CPU over loopback the
copy, the records and the replay take the cores the survivors' steps need, and ``benchmarks/catch_up.py``
measures a longer pause than sending the whole state at the entry (``docs/checkpointless.md``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastic_events.errors import HydrationError

__all__ = ["CatchUpError", "DeltaLog", "EntryKind", "EntryPlan", "StepDelta", "plan_entry", "replay"]


class CatchUpError(HydrationError):
    """A joiner's copy could not be brought to the survivors' step from the step records it was given."""


#: A parameter group's options that a step reads and a scheduler may change; 'params' is not among them.
Hyper = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepDelta:
    """What the optimizer step that made ``step`` applied: each parameter's gradient (None: no gradient,
    the parameter was left alone) in the optimizer's order, and each group's options."""

    step: int
    grads: tuple[torch.Tensor | None, ...]
    hyper: tuple[Hyper, ...]

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _hyper(optimizer: torch.optim.Optimizer) -> tuple[Hyper, ...]:
    """Each group's options as a step reads them; a tensor option (e.g. a capturable lr) is copied."""
    return tuple(
        tuple((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params")
        for group in optimizer.param_groups
    )


class DeltaLog:
    """The step records of one optimizer from ``since_step`` on (see the module).

    ``step_of()`` names the step an optimizer step makes (the training loop's counter plus one, read in
    the pre-step hook). Records are copied to ``store_device`` (the host by default: a joiner's catch-up
    must not take the accelerator's memory). At most ``max_steps`` are kept; the step after them is not
    recorded, :attr:`overflowed` turns true and the records are dropped: past the bound a full copy is
    cheaper than the records."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        since_step: int,
        max_steps: int,
        step_of: Callable[[], int],
        store_device: torch.device | str = "cpu",
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if since_step < 0:
            raise ValueError(f"since_step must be a step (>= 0), got {since_step}")
        self.since_step, self.max_steps = since_step, max_steps
        self._step_of, self._device = step_of, torch.device(store_device)
        self._deltas: list[StepDelta] = []
        self.overflowed = False
        self._handle = optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = self._step_of()
        if self.overflowed or step <= self.since_step:
            return
        if len(self._deltas) >= self.max_steps:
            self.overflowed, self._deltas = True, []
            return
        grads = tuple(
            None if p.grad is None else p.grad.detach().to(self._device, copy=True) for p in _params(optimizer)
        )
        self._deltas.append(StepDelta(step=step, grads=grads, hyper=_hyper(optimizer)))

    @property
    def deltas(self) -> tuple[StepDelta, ...]:
        return tuple(self._deltas)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self._deltas)

    def close(self) -> None:
        """Stop recording and free the records."""
        self._handle.remove()
        self._deltas = []


def replay(optimizer: torch.optim.Optimizer, deltas: Sequence[StepDelta], *, at_step: int) -> int:
    """Step ``optimizer`` (over the joiner's copy of step ``at_step``) through ``deltas``, in order; returns
    the step reached. The records must start at ``at_step + 1`` and follow one another; each must name a
    gradient of each parameter's shape and dtype, or none. Gradients are left cleared (None).

    The joiner replays before its round's hooks are attached: each replayed step is an ordinary
    ``optimizer.step()``, and hooks registered on this optimizer (or globally) run for it."""
    params = _params(optimizer)
    step = at_step
    for delta in deltas:
        if delta.step != step + 1:
            raise CatchUpError(f"step records jump from step {step} to {delta.step}: step {step + 1} is missing")
        if len(delta.grads) != len(params) or len(delta.hyper) != len(optimizer.param_groups):
            raise CatchUpError(
                f"step {delta.step}'s record holds {len(delta.grads)} gradients in {len(delta.hyper)} groups; "
                f"this optimizer has {len(params)} parameters in {len(optimizer.param_groups)} groups"
            )
        for i, (p, g) in enumerate(zip(params, delta.grads, strict=True)):
            if g is not None and (g.shape != p.shape or g.dtype != p.dtype):
                raise CatchUpError(
                    f"step {delta.step}'s gradient of parameter {i} is {tuple(g.shape)} {g.dtype}; "
                    f"the parameter is {tuple(p.shape)} {p.dtype}"
                )
            p.grad = None if g is None else g.to(p.device, copy=True)
        for group, hyper in zip(optimizer.param_groups, delta.hyper, strict=True):
            group.update(hyper)
        optimizer.step()
        step = delta.step
    for p in params:
        p.grad = None
    return step


class EntryKind(str, enum.Enum):
    """How a joiner gets the survivors' state.

    REPLAY: a copy of step ``s`` in the background, then the step records up to the entry step; the
    survivors stop only to switch groups. FULL: the whole state at the entry step, the survivors waiting
    (today's hydration); chosen when the records between the copy and the entry would pass their bound."""

    REPLAY = "replay"
    FULL = "full"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntryPlan:
    kind: EntryKind
    enter_at: int  # the step after which the joiner is in the group
    records: int  # step records the joiner replays (0 for FULL)
    paused_bytes: int  # at most what is still in flight while the survivors switch groups


def plan_entry(
    *,
    copy_step: int,
    copy_s: float,
    step_s: float,
    state_bytes: int,
    record_bytes: int,
    max_records: int,
    margin_steps: int = 1,
    pause_budget_s: float = 0.0,
) -> EntryPlan:
    """The entry of a joiner whose copy of step ``copy_step`` takes ``copy_s`` seconds to send while the
    survivors step every ``step_s`` seconds: it enters ``margin_steps`` after the step during which the copy
    arrives, replaying one record per step since ``copy_step``; the entry step's own record is made as the
    survivors leave the old group, so it may still be in flight while they switch (``paused_bytes``). Where
    that is more than ``max_records`` records, or where the full copy takes no longer than
    ``pause_budget_s``, it enters at the next step with a full copy sent while the survivors wait.

    The budget is for links that cost the survivors what they would save: on a CPU over loopback the
    background copy, the records and the joiner's replay take the cores and memory the survivors' steps
    need, and a full copy pauses them less (``benchmarks/catch_up.py``)."""
    if (
        min(copy_step, state_bytes, record_bytes) < 0
        or min(copy_s, pause_budget_s) < 0
        or step_s <= 0
        or min(max_records, margin_steps) < 1
    ):
        raise ValueError(
            "plan_entry needs copy_step, state_bytes, record_bytes >= 0, copy_s, pause_budget_s >= 0, step_s > 0, "
            f"max_records >= 1 and margin_steps >= 1; got copy_step={copy_step}, state_bytes={state_bytes}, "
            f"record_bytes={record_bytes}, copy_s={copy_s}, step_s={step_s}, max_records={max_records}, "
            f"margin_steps={margin_steps}, pause_budget_s={pause_budget_s}"
        )
    records = math.ceil(copy_s / step_s) + margin_steps
    if records <= max_records and copy_s > pause_budget_s:
        return EntryPlan(
            kind=EntryKind.REPLAY, enter_at=copy_step + records, records=records, paused_bytes=record_bytes
        )
    return EntryPlan(kind=EntryKind.FULL, enter_at=copy_step + 1, records=0, paused_bytes=state_bytes)
