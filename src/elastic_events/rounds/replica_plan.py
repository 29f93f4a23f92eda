"""Who sends which shard to whom when an HSDP round starts: a pure function of what every rank holds.

In HSDP every replica holds the same shards: the local tensors (parameters and optimizer state) of
shard index ``i`` are the same on every rank ``r`` with ``r % shard_size == i``. So when a round
starts after a scale event or a failure, a rank that needs shard ``i`` (a new replica's rank, a
crashed rank's replacement, a survivor a step behind) takes it from a rank of another replica that
kept shard ``i`` at the round's step: shard index by shard index, all in parallel, nothing gathered
and nothing re-sharded. A rank that kept its own shard keeps it; a leave moves nothing at all.

After a failure a rank may also hold its shard one step back (:mod:`.own_copy`): a peer that died
inside a step's cross-replica reduction can leave that step applied on some shard indices only, and
the round then goes on from the step before, which every shard index is held at.

:func:`plan_replicas` makes the plan from each new rank's :class:`Holding`, or raises
:class:`ReplicaPlanError` when some shard index is held by no rank at the round's step (the caller
then falls back to snapshots or storage).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastic_events.errors import HydrationError
from elastic_events.rounds.mesh import MeshLayout

__all__ = ["Holding", "ReplicaPlan", "ReplicaPlanError", "ShardTransfer", "plan_replicas"]


class ReplicaPlanError(HydrationError):
    """No replica holds some shard at the step the others are at."""


@dataclass(frozen=True, kw_only=True)
class Holding:
    """The local state a rank kept from its previous round: shard ``shard`` of a mesh in shards of
    ``shard_size``, trained to ``step``, and the same shard at ``previous`` (an older step) if it kept that too."""

    shard_size: int
    shard: int
    step: int
    previous: int | None = None

    def steps(self) -> tuple[int, ...]:
        return (self.step,) if self.previous is None else (self.step, self.previous)


@dataclass(frozen=True, kw_only=True)
class ShardTransfer:
    """Shard ``shard`` goes from ``source`` (a rank that kept it) to ``receivers`` (ranks of the new round)."""

    shard: int
    source: int
    receivers: tuple[int, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(sorted((self.source, *self.receivers)))


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    step: int  # the step every rank is brought to
    newest: int  # the newest step any rank kept (> step: ranks ahead go back, ``newest - step`` steps redone)
    layout: MeshLayout  # the new round's
    keepers: tuple[int, ...]  # ranks that load the shard they kept
    transfers: tuple[ShardTransfer, ...]  # shard indices with receivers, in shard order
    small_source: int  # the rank whose small state (step, scheduler, sampler) every rank takes

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(sorted(r for t in self.transfers for r in t.receivers))

    def bytes_moved(self, shard_bytes: Mapping[int, int]) -> int:
        """Bytes the plan moves, given each transferred shard's bytes."""
        return sum(shard_bytes[t.shard] * len(t.receivers) for t in self.transfers)


def plan_replicas(holdings: Mapping[int, Holding | None], layout: MeshLayout) -> ReplicaPlan:
    """Each new rank's shard: kept, or from the lowest rank that kept that shard index at the newest step.

    ``holdings`` maps every rank of the new round to what it kept (None: nothing, a newcomer). Only a
    holding of a mesh in shards of ``layout.shard_size`` counts (another shard size slices the tensors
    otherwise). The step is the newest at which every shard index is held by some rank (after a failure
    a survivor may have committed one more step than another: the one that is ahead then goes back to
    the copy it kept of the step before, where some shard index was not committed); a rank that kept an
    older one is brought to it like a newcomer. A rank that kept its own shard index is preferred as a
    source; one whose index changed (a replica that spans nodes, renumbered) gives what it kept and
    receives its new shard.
    """
    if sorted(holdings) != list(range(layout.world_size)):
        raise ReplicaPlanError(f"the plan needs every rank of the {layout.world_size}, got ranks {sorted(holdings)}")
    usable = {r: h for r, h in holdings.items() if h is not None and h.shard_size == layout.shard_size}
    if not usable:
        raise ReplicaPlanError(f"no rank kept a shard of a mesh in shards of {layout.shard_size}")
    newest = max(h.step for h in usable.values())
    step = _newest_complete(usable, layout.shard_size)
    current = {r: h.shard for r, h in usable.items() if step in h.steps()}
    keepers = tuple(r for r in sorted(current) if current[r] == layout.shard_of(r))
    transfers = []
    missing = []
    for shard in range(layout.shard_size):
        needed = [r for r in layout.ranks_of_shard(shard) if r not in keepers]
        if not needed:
            continue
        holders = [r for r in sorted(current) if current[r] == shard]
        if not holders:
            missing.append(shard)
            continue
        source = min(holders, key=lambda r: (r not in keepers, r))  # a keeper of its own shard if there is one
        transfers.append(ShardTransfer(shard=shard, source=source, receivers=tuple(needed)))
    if missing:
        held = {r: (h.shard, h.steps()) for r, h in sorted(usable.items())}
        raise ReplicaPlanError(
            f"shard(s) {missing} of {layout.describe()} are held by no rank at step {step} "
            f"(kept (shard, steps) by rank: {held})"
        )
    return ReplicaPlan(
        step=step,
        newest=newest,
        layout=layout,
        keepers=keepers,
        transfers=tuple(transfers),
        small_source=min(current),
    )


def _newest_complete(usable: Mapping[int, Holding], shard_size: int) -> int:
    """The newest step at which every shard index is held by some rank (else the newest any rank kept: the
    plan then names the shards that are missing there)."""
    steps = sorted({step for h in usable.values() for step in h.steps()}, reverse=True)
    for step in steps:
        if {h.shard for h in usable.values() if step in h.steps()} >= set(range(shard_size)):
            return step
    return steps[0]
