"""Exactly-once elastic data: a batch sampler whose state is a global position.

The state of :class:`ElasticSampler` is ``(seed, epoch, consumed)``: ``consumed``
counts the samples of the epoch the *whole job* has trained on. It does not depend
on the world size, so a job that changes size mid-epoch resumes at the same place:

* each epoch has one global permutation of the dataset (``torch.Generator`` seeded
  with ``seed + epoch``; ``shuffle=False`` gives the identity);
* every optimizer step takes the next ``global_batch`` indices of the permutation,
  starting at ``consumed``, and splits them over the *current* ranks with
  :func:`~elastic_events.data.batching.plan_global_batch`;
* the rank yields its share as micro-batches (lists of indices), so
  ``StatefulDataLoader(dataset, batch_sampler=sampler)`` yields this rank's
  micro-batches in order.

After a change of world size (a new sampler built at the new rank and world size,
with the saved state loaded) the rest of the epoch is split over the new ranks, and
every sample of the epoch is trained on exactly once.

The last partial global batch of an epoch: with ``drop_last=True`` (the default,
constant global batch) its samples are skipped that epoch; with ``drop_last=False``
it is trained as a smaller global batch, and when it has fewer samples than there
are ranks some ranks get an empty step (no micro-batches) and must still take part
in the gradient reduction (e.g. backward a zero loss).

Trained, not prefetched. A data loader with workers draws micro-batches ahead of
the training loop. The sampler's position moves only when the loop calls
:meth:`ElasticSampler.mark_step` after an optimizer step, so :meth:`state_dict`
is exactly what was trained on. The epoch rolls over when the last step of the
epoch is marked. Usage::

    sampler = ElasticSampler(len(dataset), global_batch=128, micro_batch=8)  # rank/world from torch.distributed
    if checkpoint is not None:
        sampler.load_state_dict(checkpoint["sampler"])    # saved at any world size
    loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=2)
    while sampler.epoch < num_epochs:
        for step in sampler.steps(loader):                # one global batch per step
            for n, mb in zip(step.micro_batch_sizes, step.micro_batches):
                (model(mb) * loss_scale(n, step.global_count, world_size=world)).backward()
            optimizer.step(); optimizer.zero_grad()
            sampler.mark_step()
            if elastic_event_detected():
                save({"sampler": sampler.state_dict(), ...}); return

Checkpoint ``sampler.state_dict()``; on restore build a fresh loader over the
positioned sampler. ``StatefulDataLoader.state_dict()`` also works when taken at
a step boundary: the loader snapshots the sampler's *iterator* (whose state is the
position after the last micro-batch it handed out) together with each batch, and
restoring it repositions the sampler there (the number of loader workers must then
be the same, a torchdata restriction).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from elastic_events.contract import rank_context

from .batching import BatchPlan, BatchPlanError, plan_global_batch

__all__ = [
    "ElasticSampler",
    "ElasticSamplerError",
    "GlobalStep",
    "SamplerConfigError",
    "SamplerStateError",
    "SamplerUsageError",
    "epoch_permutation",
]

STATE_VERSION = 1


class ElasticSamplerError(Exception):
    """Base class of the sampler's errors."""


class SamplerConfigError(ElasticSamplerError, ValueError):
    """The sampler's arguments are invalid."""


class SamplerStateError(ElasticSamplerError, ValueError):
    """A state dict is malformed or belongs to another dataset or ordering."""


class SamplerUsageError(ElasticSamplerError, RuntimeError):
    """The sampler was driven in a way that would lose or repeat samples."""


def epoch_permutation(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of the samples in ``epoch``: the same on every rank and world size."""
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


@dataclass(frozen=True, kw_only=True)
class GlobalStep:
    """This rank's share of one global batch, as yielded by :meth:`ElasticSampler.steps`."""

    epoch: int
    start: int  # position of the global batch in the epoch's permutation
    plan: BatchPlan  # how the global batch is split; plan.rank is this rank
    micro_batches: list[Any]  # the loader's collated micro-batches, in order

    @property
    def global_count(self) -> int:
        """Samples in the whole global batch (smaller than global_batch only for a kept tail)."""
        return self.plan.global_batch

    @property
    def micro_batch_sizes(self) -> list[int]:
        """Samples in each of this rank's micro-batches."""
        return self.plan.micro_batches()


def _default_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        default = dist.get_rank(), dist.get_world_size()
    else:  # the round the launcher started the process in (0 of 1 for a plain script); ElasticTraining re-splits
        ctx = rank_context()
        default = ctx.rank, ctx.world_size
    return (default[0] if rank is None else rank, default[1] if world_size is None else world_size)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplerConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise SamplerConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


class ElasticSampler(Sampler[list[int]]):
    """Batch sampler yielding this rank's micro-batches of each global batch.

    Args:
        num_samples: size of the dataset.
        global_batch: samples per optimizer step, over all ranks.
        micro_batch: largest micro-batch a rank runs forward at once.
        rank, world_size: this rank in the current data-parallel world; default
            to torch.distributed's when it is initialised.
        seed: base of the per-epoch permutation (``seed + epoch``).
        shuffle: permute the samples every epoch (False: dataset order).
        drop_last: skip the last partial global batch of each epoch.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self._num_samples = _check_int("num_samples", num_samples, minimum=1)
        self._seed = _check_int("seed", seed, minimum=0)
        rank, world_size = _default_rank_world(rank, world_size)
        try:
            self._full_plan = plan_global_batch(
                global_batch=global_batch, micro_batch=micro_batch, world_size=world_size, rank=rank
            )
        except BatchPlanError as exc:
            raise SamplerConfigError(str(exc)) from exc
        if drop_last and global_batch > num_samples:
            raise SamplerConfigError(
                f"global_batch={global_batch} exceeds num_samples={num_samples}: with drop_last=True "
                "an epoch would have no step"
            )
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._consumed = 0
        self._drawn = (0, 0)  # position up to which the newest iterator handed out all of this rank's samples
        self._generation = 0  # bumped by load_state_dict: iterators from before it are stale
        self._newest_iterator = 0
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    # ----------------------------------------------------------------- properties
    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def global_batch(self) -> int:
        return self._full_plan.global_batch

    @property
    def micro_batch(self) -> int:
        return self._full_plan.micro_batch

    @property
    def rank(self) -> int:
        rank = self._full_plan.rank
        if rank is None:  # every plan here is made with this rank's number
            raise SamplerConfigError("the sampler's batch plan has no rank")
        return rank

    @property
    def world_size(self) -> int:
        return self._full_plan.world_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def epoch(self) -> int:
        """Epoch of the next step to train."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch trained on by the whole job."""
        return self._consumed

    @property
    def drawn(self) -> tuple[int, int]:
        """``(epoch, position)`` up to which the newest iterator handed out all of this
        rank's micro-batches: how far a loader has read ahead of :attr:`consumed`."""
        return self._drawn

    @property
    def plan(self) -> BatchPlan:
        """Split of a full global batch over the current world."""
        return self._full_plan

    @property
    def epoch_end(self) -> int:
        """Position at which an epoch ends (before the dropped tail, if any)."""
        if self._drop_last:
            return self._num_samples - self._num_samples % self.global_batch
        return self._num_samples

    @property
    def remaining_steps(self) -> int:
        """Optimizer steps left in the current epoch."""
        return len(self._batch_starts(self._consumed))

    # ------------------------------------------------------------------ planning
    def _normalize(self, epoch: int, consumed: int) -> tuple[int, int]:
        """A position at (or past) the epoch's end is the start of the next epoch."""
        if consumed >= self.epoch_end:
            return epoch + 1, 0
        return epoch, consumed

    def _plan_at(self, start: int) -> BatchPlan:
        count = min(self.global_batch, self._num_samples - start)
        if count == self.global_batch:
            return self._full_plan
        return plan_global_batch(
            global_batch=count,
            micro_batch=self.micro_batch,
            world_size=self.world_size,
            rank=self.rank,
            allow_idle_ranks=True,
        )

    def _batch_starts(self, start: int) -> range:
        return range(start, self.epoch_end, self.global_batch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = epoch_permutation(self._num_samples, seed=self._seed, epoch=epoch, shuffle=self._shuffle)
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def global_batch_indices(self, epoch: int, start: int) -> list[int]:
        """Dataset indices of the global batch at ``start`` of ``epoch`` (all ranks' shares)."""
        count = self._plan_at(start).global_batch
        return self._permutation(epoch)[start : start + count].tolist()

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[list[int]]:
        self._newest_iterator += 1
        return _MicroBatchIterator(self, token=self._newest_iterator)

    def __len__(self) -> int:
        """Micro-batches this rank yields from the trained position to the epoch's end."""
        return sum(self._plan_at(start).accumulation_steps() for start in self._batch_starts(self._consumed))

    def _note_drawn(self, token: int, epoch: int, consumed: int) -> None:
        if token == self._newest_iterator:
            self._drawn = (epoch, consumed)

    def mark_step(self) -> None:
        """Record that the global batch at the trained position has been trained on.

        Call once per optimizer step, after it. Raises :class:`SamplerUsageError` if
        this rank has not yet drawn all its micro-batches of that global batch.
        """
        start = self._consumed
        after = self._normalize(self._epoch, start + self._plan_at(start).global_batch)
        if after > self._drawn:
            raise SamplerUsageError(
                f"mark_step() at epoch {self._epoch} position {start}: rank {self.rank} has drawn its "
                f"micro-batches only up to epoch {self._drawn[0]} position {self._drawn[1]}; call "
                "mark_step() once per optimizer step, after training on the step's micro-batches"
            )
        self._epoch, self._consumed = after

    def steps(self, loader: Iterable[Any]) -> Iterator[GlobalStep]:
        """Group ``loader``'s micro-batches into the optimizer steps of the current epoch.

        ``loader`` must use this sampler as its ``batch_sampler``. Each yielded step
        must be followed by :meth:`mark_step` before the next one is requested.
        """
        it = iter(loader)  # may restore a loader state, which repositions this sampler
        epoch = self._epoch
        while self._epoch == epoch:
            start = self._consumed
            plan = self._plan_at(start)
            micro_batches = []
            for i in range(plan.accumulation_steps()):
                try:
                    micro_batches.append(next(it))
                except StopIteration:
                    raise SamplerUsageError(
                        f"the loader ended after {i} of {plan.accumulation_steps()} micro-batches of the step "
                        f"at epoch {epoch} position {start}; its batch_sampler must be this sampler"
                    ) from None
            yield GlobalStep(epoch=epoch, start=start, plan=plan, micro_batches=micro_batches)
            expected = self._normalize(epoch, start + plan.global_batch)
            if (self._epoch, self._consumed) != expected:
                raise SamplerUsageError(
                    f"after the step at epoch {epoch} position {start} the sampler is at epoch {self._epoch} "
                    f"position {self._consumed}, expected {expected}: call mark_step() exactly once per step"
                )
        leftover = next(it, _END)
        if leftover is not _END:
            raise SamplerUsageError(
                f"the loader yielded more micro-batches than the sampler planned for epoch {epoch}; "
                "its batch_sampler must be this sampler"
            )

    # --------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The trained position: valid at any world size, rank and micro-batch size."""
        return {
            "version": STATE_VERSION,
            "seed": self._seed,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "num_samples": self._num_samples,
            "shuffle": self._shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state saved by any rank at any world size.

        Iterators created before the call become invalid: build a fresh loader
        iterator after it.
        """
        state = _validated_state(state_dict)
        if state["num_samples"] != self._num_samples:
            raise SamplerStateError(
                f"state num_samples={state['num_samples']} does not match this sampler's "
                f"num_samples={self._num_samples}: the dataset changed"
            )
        if state["shuffle"] != self._shuffle:
            raise SamplerStateError(
                f"state shuffle={state['shuffle']} does not match this sampler's shuffle={self._shuffle}"
            )
        if state["consumed"] > self._num_samples:
            raise SamplerStateError(f"state consumed={state['consumed']} exceeds num_samples={self._num_samples}")
        self._seed = state["seed"]
        self._set_position(state["epoch"], state["consumed"])
        self._generation += 1

    def set_world(self, *, rank: int, world_size: int) -> None:
        """Split the following global batches over a new world (an in-process resize).

        The trained position is kept; iterators created before the call become invalid:
        build a fresh loader iterator after it.
        """
        try:
            plan = plan_global_batch(
                global_batch=self.global_batch, micro_batch=self.micro_batch, world_size=world_size, rank=rank
            )
        except BatchPlanError as exc:
            raise SamplerConfigError(str(exc)) from exc
        self._full_plan = plan
        self._set_position(self._epoch, self._consumed)
        self._generation += 1

    def _set_position(self, epoch: int, consumed: int) -> None:
        self._epoch, self._consumed = self._normalize(epoch, consumed)
        self._drawn = (self._epoch, self._consumed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self._num_samples}, global_batch={self.global_batch}, "
            f"micro_batch={self.micro_batch}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, consumed={self._consumed})"
        )


_END = object()

_STATE_FIELDS: dict[str, type] = {
    "version": int,
    "seed": int,
    "epoch": int,
    "consumed": int,
    "num_samples": int,
    "shuffle": bool,
}


def _validated_state(state_dict: Any) -> dict[str, Any]:
    if not isinstance(state_dict, dict):
        raise SamplerStateError(f"sampler state must be a dict, got {type(state_dict).__name__}")
    missing = sorted(set(_STATE_FIELDS) - set(state_dict))
    if missing:
        raise SamplerStateError(f"sampler state lacks {', '.join(missing)}")
    for name, kind in _STATE_FIELDS.items():
        value = state_dict[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SamplerStateError(f"sampler state {name} must be a non-negative int, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise SamplerStateError(f"sampler state {name} must be a bool, got {value!r}")
    if state_dict["version"] != STATE_VERSION:
        raise SamplerStateError(f"sampler state version {state_dict['version']} is not {STATE_VERSION}")
    return state_dict


class _MicroBatchIterator(Iterator[list[int]]):
    """Hands out this rank's micro-batches from the sampler's trained position to the epoch's end.

    It is stateful for torchdata: :class:`StatefulDataLoader` snapshots
    :meth:`state_dict` with every batch it dispatches, and restoring that snapshot
    moves both this iterator and the sampler's trained position there.
    """

    def __init__(self, sampler: ElasticSampler, *, token: int) -> None:
        self._sampler = sampler
        self._token = token
        self._generation = sampler._generation
        self._first_epoch = sampler.epoch
        self._epoch, self._consumed = sampler.epoch, sampler.consumed
        self._micro = 0  # micro-batches of the current global batch already handed out
        self._skip_idle()

    def __iter__(self) -> _MicroBatchIterator:
        return self

    def _skip_idle(self) -> None:
        """Move past global batches in which this rank has no samples (a small kept tail)."""
        s = self._sampler
        while self._epoch == self._first_epoch:
            plan = s._plan_at(self._consumed)
            if plan.local_samples() > 0:
                break
            self._epoch, self._consumed = s._normalize(self._epoch, self._consumed + plan.global_batch)
        s._note_drawn(self._token, self._epoch, self._consumed)

    def __next__(self) -> list[int]:
        s = self._sampler
        if self._generation != s._generation:
            raise SamplerUsageError(
                "the sampler's state was loaded while this iterator was running; "
                "create a new loader iterator after load_state_dict()"
            )
        if self._epoch != self._first_epoch:
            raise StopIteration
        plan = s._plan_at(self._consumed)
        sizes = plan.micro_batches()
        begin = self._consumed + plan.rank_offsets[s.rank] + sum(sizes[: self._micro])
        indices = s._permutation(self._epoch)[begin : begin + sizes[self._micro]].tolist()
        self._micro += 1
        if self._micro == len(sizes):
            self._epoch, self._consumed = s._normalize(self._epoch, self._consumed + plan.global_batch)
            self._micro = 0
            self._skip_idle()
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "consumed": self._consumed,
            "micro_batches_drawn": self._micro,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in ("epoch", "consumed", "micro_batches_drawn"):
            value = state_dict.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SamplerStateError(
                    f"loader sampler-iterator state {name} must be a non-negative int, got {value!r}"
                )
        if state_dict["micro_batches_drawn"]:
            raise SamplerStateError(
                f"the loader state was saved in the middle of a global batch (epoch {state_dict['epoch']} "
                f"position {state_dict['consumed']}, {state_dict['micro_batches_drawn']} micro-batches drawn): "
                "save it at a step boundary, after mark_step()"
            )
        s = self._sampler
        if state_dict["consumed"] > s.num_samples:
            raise SamplerStateError(
                f"loader sampler-iterator state consumed={state_dict['consumed']} exceeds num_samples={s.num_samples}"
            )
        s._set_position(state_dict["epoch"], state_dict["consumed"])
        # The restored iterator runs to the end of the epoch it resumes in.
        self._first_epoch = self._epoch = s.epoch
        self._consumed = s.consumed
        self._micro = 0
        self._skip_idle()
