"""The device mesh of a round: the one place a rank's ``("replicate", "shard")`` mesh is planned and built.

HSDP (hybrid sharded data parallel) shards parameters, gradients and optimizer state inside a
*replica* of ``shard_size`` consecutive ranks and replicates them across replicas. By default a
replica is the ranks of one node (``LOCAL_WORLD_SIZE``): a node that joins or leaves adds or removes
whole replicas, and every rank keeps its shard index (``rank % shard_size``) from round to round.

:class:`HSDPConfig` is what a script asks for; :func:`plan_layout` (pure) turns it and a round's world
into a :class:`MeshLayout`, or raises :class:`MeshLayoutError` when the world is not a whole number of
replicas; :func:`build_mesh` makes the round's :class:`~torch.distributed.device_mesh.DeviceMesh`
(collective over the round's group). FSDP2's ``fully_shard(module, mesh=mesh)`` on a 2-D mesh is HSDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elastic_events.errors import ElasticTrainingError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MESH_DIMS",
    "HSDPConfig",
    "MeshLayout",
    "MeshLayoutError",
    "build_mesh",
    "hsdp_wrap",
    "plan_layout",
]

#: The mesh's dimension names, outermost first (torchtitan's names for HSDP).
MESH_DIMS = ("replicate", "shard")


class MeshLayoutError(ElasticTrainingError, ValueError):
    """The world cannot be laid out as the asked-for mesh (not a whole number of replicas)."""


@dataclass(frozen=True, kw_only=True)
class HSDPConfig:
    """HSDP: shard inside groups of ``shard_size`` ranks, replicate across them.

    ``shard_size`` None: the ranks of one node (``LOCAL_WORLD_SIZE``), so nodes are whole replicas.
    """

    shard_size: int | None = None

    def __post_init__(self) -> None:
        size = self.shard_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise MeshLayoutError(f"HSDPConfig.shard_size must be None or an integer >= 1, got {size!r}")


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """A world of ``replicas`` x ``shard_size`` ranks; rank ``r`` is shard ``r % shard_size`` of replica
    ``r // shard_size`` (the ranks of a node are consecutive, so a replica is on as few nodes as can be)."""

    world_size: int
    shard_size: int

    def __post_init__(self) -> None:
        if self.shard_size < 1 or self.world_size < 1:
            raise MeshLayoutError(f"a mesh of {self.world_size} ranks in shards of {self.shard_size}")
        if self.world_size % self.shard_size:
            raise MeshLayoutError(
                f"HSDP shard size {self.shard_size} does not divide the world of {self.world_size} ranks: "
                f"the world must be a whole number of replicas (nodes x ranks per node a multiple of "
                f"{self.shard_size}; --replica-increment-step keeps it so)"
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def shape(self) -> tuple[int, int]:
        return (self.replicas, self.shard_size)

    def shard_of(self, rank: int) -> int:
        return rank % self.shard_size

    def replica_of(self, rank: int) -> int:
        return rank // self.shard_size

    def ranks_of_shard(self, shard: int) -> tuple[int, ...]:
        """The ranks that hold shard ``shard``, one per replica (its ``replicate`` group)."""
        return tuple(range(shard, self.world_size, self.shard_size))

    def describe(self) -> str:
        return f"HSDP {self.replicas} replica(s) x {self.shard_size} shard(s)"


def plan_layout(config: HSDPConfig, *, world_size: int, local_world_size: int) -> MeshLayout:
    """The mesh of a world of ``world_size`` ranks, nodes of ``local_world_size``; :class:`MeshLayoutError`
    when the world is not a whole number of replicas."""
    shard = config.shard_size if config.shard_size is not None else local_world_size
    return MeshLayout(world_size=world_size, shard_size=shard)


#: The first mesh this process built of each shape and ranks; later rounds of that shape reuse it (:func:`build_mesh`).
_MESHES: dict[DeviceMesh, DeviceMesh] = {}


def build_mesh(layout: MeshLayout, device: torch.device) -> DeviceMesh:
    """The round's 2-D mesh over its default group (collective: every rank of the round calls it).

    A ``DeviceMesh`` compares equal to any other of the same ranks, shape and names (``__eq__`` and
    ``__hash__`` leave its process groups out), and DTensor caches its sharding propagations by mesh,
    output specs included. A round whose mesh is equal to an earlier round's would therefore get that
    earlier mesh back from the cache (an in-place op's output spec replaces the parameter's), and its
    subgroups were destroyed with that round ("Could not resolve the process group registered under the
    name ..."). So the first mesh of each shape is kept, and a later round of the same shape gets that same
    object back with the new round's subgroups in it: the cached specs name it, and it resolves to the live
    groups, and it takes this rank's coordinates in it from the new round's mesh. Its cache stays warm: the
    first step after an event that returns to a shape seen before does not compute DTensor's ~50
    propagations again (about 1.2 s of CPU on the tiny model here; a new shape still pays them).
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=MESH_DIMS)
    earlier = _MESHES.setdefault(mesh, mesh)
    if earlier is not mesh:
        # the new round's subgroups, under the names its get_group() resolves; flattened meshes are remade;
        # this rank's place in it (a rank renumbered by an event sits elsewhere in a mesh of the same shape)
        earlier._dim_group_names = list(mesh._dim_group_names)
        earlier._pg_registry = dict(mesh._pg_registry)
        earlier._flatten_mapping = dict(mesh._flatten_mapping)
        earlier._rank = mesh._rank
        earlier._coordinate_on_dim = mesh._coordinate_on_dim
    return earlier


def hsdp_wrap(module: torch.nn.Module, *, mesh: DeviceMesh | None) -> torch.nn.Module:
    """The default wrap of an HSDP job: ``fully_shard`` of the whole model on the round's mesh (none: as it is)."""
    if mesh is None:
        return module
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)  # the module itself, now sharded
    return module
