"""HSDP layouts and who sends which shard to whom at joins, leaves and repairs (pure: no processes)."""

from __future__ import annotations

import pytest

from elastic_events import ElasticConfig, HSDPConfig, MeshLayoutError
from elastic_events.rounds.config import ElasticConfigError
from elastic_events.rounds.mesh import MeshLayout, plan_layout
from elastic_events.rounds.replica_plan import Holding, ReplicaPlanError, ShardTransfer, plan_replicas


def held(shard_size: int, step: int, **ranks: int | None) -> dict[int, Holding | None]:
    """``r0=0, r1=None``: rank 0 kept shard 0 at ``step``, rank 1 kept nothing."""
    return {
        int(name[1:]): None if shard is None else Holding(shard_size=shard_size, shard=shard, step=step)
        for name, shard in ranks.items()
    }


# ------------------------------------------------------------------------------ layouts


def test_the_default_shard_group_is_a_node_and_ranks_keep_their_shard_index() -> None:
    layout = plan_layout(HSDPConfig(), world_size=6, local_world_size=2)
    assert (layout.replicas, layout.shard_size, layout.shape) == (3, 2, (3, 2))
    assert [layout.shard_of(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [layout.replica_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert layout.ranks_of_shard(1) == (1, 3, 5)
    assert plan_layout(HSDPConfig(shard_size=4), world_size=8, local_world_size=8).shape == (2, 4)


@pytest.mark.parametrize(("world", "shard"), [(6, 4), (3, 2), (2, 4)])
def test_a_world_that_is_not_whole_replicas_is_refused_with_what_to_change(world: int, shard: int) -> None:
    with pytest.raises(MeshLayoutError, match=f"shard size {shard} does not divide the world of {world} ranks"):
        plan_layout(HSDPConfig(shard_size=shard), world_size=world, local_world_size=2)


@pytest.mark.parametrize("size", [0, -2, 1.5, True, "2"])
def test_hsdp_config_takes_a_positive_shard_size_or_none(size: object) -> None:
    with pytest.raises(MeshLayoutError, match="HSDPConfig.shard_size must be None or an integer >= 1"):
        HSDPConfig(shard_size=size)  # type: ignore[arg-type]


def test_elastic_config_takes_an_hsdp_config_only() -> None:
    assert ElasticConfig(hsdp=HSDPConfig(shard_size=2)).hsdp == HSDPConfig(shard_size=2)
    with pytest.raises(ElasticConfigError, match="ElasticConfig.hsdp must be None or an HSDPConfig"):
        ElasticConfig(hsdp=2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the plans


def test_a_joining_node_gets_each_shard_from_the_same_shard_rank_of_one_replica() -> None:
    """2 x 2 -> 3 x 2: new ranks 4 and 5 (node c) take shards 0 and 1 from ranks 0 and 1, in parallel."""
    plan = plan_replicas(held(2, 7, r0=0, r1=1, r2=0, r3=1, r4=None, r5=None), MeshLayout(world_size=6, shard_size=2))
    assert plan.step == 7 and plan.keepers == (0, 1, 2, 3)
    assert plan.transfers == (
        ShardTransfer(shard=0, source=0, receivers=(4,)),
        ShardTransfer(shard=1, source=1, receivers=(5,)),
    )
    assert plan.receivers == (4, 5) and plan.small_source == 0
    assert plan.bytes_moved({0: 100, 1: 90}) == 190  # one replica's state


def test_two_joining_nodes_receive_in_one_broadcast_per_shard() -> None:
    plan = plan_replicas(
        held(2, 3, r0=0, r1=1, r2=None, r3=None, r4=None, r5=None), MeshLayout(world_size=6, shard_size=2)
    )
    assert [t.members for t in plan.transfers] == [(0, 2, 4), (1, 3, 5)]
    assert plan.bytes_moved({0: 10, 1: 10}) == 40


def test_a_leaving_node_moves_nothing_even_when_the_survivors_are_renumbered() -> None:
    """3 x 2 -> 2 x 2, node a (ranks 0, 1) left: b and c are now ranks 0-3, each still on its shard index."""
    plan = plan_replicas(held(2, 9, r0=0, r1=1, r2=0, r3=1), MeshLayout(world_size=4, shard_size=2))
    assert plan.transfers == () and plan.keepers == (0, 1, 2, 3) and plan.receivers == ()
    assert plan.bytes_moved({}) == 0


def test_a_crashed_ranks_replacement_takes_its_shard_from_another_replica() -> None:
    plan = plan_replicas(held(2, 5, r0=0, r1=None, r2=0, r3=1), MeshLayout(world_size=4, shard_size=2))
    assert plan.transfers == (ShardTransfer(shard=1, source=3, receivers=(1,)),)
    assert plan.keepers == (0, 2, 3)


def test_after_a_failure_the_newest_step_is_the_state_and_a_survivor_behind_is_brought_to_it() -> None:
    holdings = {
        0: Holding(shard_size=2, shard=0, step=5),  # did not commit step 5's successor
        1: None,
        2: Holding(shard_size=2, shard=0, step=6),
        3: Holding(shard_size=2, shard=1, step=6),
    }
    plan = plan_replicas(holdings, MeshLayout(world_size=4, shard_size=2))
    assert plan.step == 6 and plan.keepers == (2, 3) and plan.small_source == 2
    assert plan.transfers == (
        ShardTransfer(shard=0, source=2, receivers=(0,)),
        ShardTransfer(shard=1, source=3, receivers=(1,)),
    )


def test_a_shard_no_replica_holds_at_the_newest_step_is_an_error_naming_it() -> None:
    """A whole node lost with the last replica of shard 1 at the newest step: snapshots or storage must take over."""
    holdings = {0: Holding(shard_size=2, shard=0, step=6), 1: Holding(shard_size=2, shard=1, step=5)}
    with pytest.raises(ReplicaPlanError, match=r"shard\(s\) \[1\] of HSDP 1 replica\(s\) x 2 shard\(s\)"):
        plan_replicas(holdings, MeshLayout(world_size=2, shard_size=2))


def test_a_step_applied_on_some_shard_indices_only_is_trained_again_from_the_copy_one_step_back() -> None:
    """Rank 1 died inside step 6's cross-replica reduction: shard 0's ranks (0, 2) applied step 6, shard 1's
    only survivor (3) did not. Without the copies one step back no rank held every shard at one step
    (CI: the job started again from step 0); with them the round goes on from step 5 and redoes step 6."""
    layout = MeshLayout(world_size=4, shard_size=2)
    live = {0: (0, 6), 1: None, 2: (0, 6), 3: (1, 5)}
    with pytest.raises(ReplicaPlanError, match=r"shard\(s\) \[1\] .* held by no rank at step 6"):
        plan_replicas({r: h and Holding(shard_size=2, shard=h[0], step=h[1]) for r, h in live.items()}, layout)
    holdings = {r: h and Holding(shard_size=2, shard=h[0], step=h[1], previous=h[1] - 1) for r, h in live.items()}
    plan = plan_replicas(holdings, layout)
    assert (plan.step, plan.newest, plan.keepers, plan.small_source) == (5, 6, (0, 2, 3), 0)
    assert plan.transfers == (ShardTransfer(shard=1, source=3, receivers=(1,)),)


def test_the_copy_one_step_back_is_not_used_when_every_shard_is_held_at_the_newest_step() -> None:
    holdings = {r: Holding(shard_size=2, shard=r % 2, step=6, previous=5) for r in (0, 2, 3)} | {1: None}
    plan = plan_replicas(holdings, MeshLayout(world_size=4, shard_size=2))
    assert (plan.step, plan.newest, plan.keepers) == (6, 6, (0, 2, 3))


def test_shards_of_another_shard_size_do_not_count() -> None:
    with pytest.raises(ReplicaPlanError, match="no rank kept a shard of a mesh in shards of 2"):
        plan_replicas(held(4, 1, r0=0, r1=1), MeshLayout(world_size=2, shard_size=2))


def test_every_rank_of_the_round_must_be_in_the_plan() -> None:
    with pytest.raises(ReplicaPlanError, match="needs every rank of the 4"):
        plan_replicas(held(2, 1, r0=0, r1=1), MeshLayout(world_size=4, shard_size=2))


def test_a_replica_spanning_two_nodes_renumbered_sends_what_it_kept_and_receives_its_new_shard() -> None:
    """Shards of 4 over nodes of 2 ranks (a replica is two nodes). Node b (shards 2, 3 of replica 0) was
    renumbered to ranks 0, 1 (shards 0, 1); ranks 4, 5 kept shards 0, 1; ranks 2, 3, 6, 7 are new. Ranks
    0 and 1 are the only holders of shards 2 and 3: they send them, and receive shards 0 and 1."""
    holdings = held(4, 2, r0=2, r1=3, r2=None, r3=None, r4=0, r5=1, r6=None, r7=None)
    plan = plan_replicas(holdings, MeshLayout(world_size=8, shard_size=4))
    assert plan.keepers == (4, 5)
    assert plan.transfers == (
        ShardTransfer(shard=0, source=4, receivers=(0,)),
        ShardTransfer(shard=1, source=5, receivers=(1,)),
        ShardTransfer(shard=2, source=0, receivers=(2, 6)),
        ShardTransfer(shard=3, source=1, receivers=(3, 7)),
    )
    assert plan.small_source == 0
