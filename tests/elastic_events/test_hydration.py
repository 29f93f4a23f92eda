"""Who hydrates whom, and what state is refused (pure), and the tensor/skeleton split of optimizer state."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from elastic_events.rounds.hydration import (
    HydrationError,
    RankReport,
    StateMismatchError,
    TensorSpec,
    allocate_tensors,
    collective_failures,
    plan_from_handoff,
    plan_hydration,
    split_tensors,
    structure_digest,
    value_checksum,
)
from elastic_events.rounds.replica_plan import Holding
from elastic_events.rounds.snapshot_restore import SnapshotReport


def survivor(
    rank: int, step: int = 10, checksum: str = "c0", *, sharded: bool = False, ready: bool = True
) -> RankReport:
    return RankReport(
        rank=rank,
        survivor=True,
        source_ready=ready,
        step=step,
        structure="s",
        checksum=None if sharded else checksum,
        sharded=sharded,
    )


def newcomer(rank: int, structure: str = "s") -> RankReport:
    return RankReport(
        rank=rank, survivor=False, source_ready=False, step=-1, structure=structure, checksum=None, sharded=None
    )


def test_the_lowest_ready_survivor_sends_to_the_newcomers() -> None:
    plan = plan_hydration([newcomer(3), survivor(1), survivor(0), newcomer(2)])
    assert (plan.source, plan.newcomers, plan.survivors, plan.sharded, plan.step) == (0, (2, 3), (0, 1), False, 10)


def test_sharded_state_comes_from_the_rank_holding_the_full_state() -> None:
    reports = [survivor(0, sharded=True), survivor(1, sharded=True, ready=False), newcomer(2)]
    plan = plan_hydration(reports)
    assert (plan.source, plan.sharded, plan.newcomers) == (0, True, (2,))


def test_without_survivors_there_is_no_source() -> None:
    plan = plan_hydration([newcomer(0), newcomer(1)])
    assert (plan.source, plan.survivors, plan.step) == (None, (), -1)


@pytest.mark.parametrize(
    ("newcomers", "source"),
    [
        ((5,), 4),  # a crashed rank on node 1 (ranks 4..7): a sibling sends, no other node is needed
        ((1,), 0),  # on node 0: rank 0 is its sibling anyway
        ((5, 9), 0),  # newcomers on two nodes: one broadcast from the lowest ready rank
    ],
)
def test_a_newcomer_is_hydrated_by_a_survivor_on_its_own_node(newcomers, source) -> None:
    reports = [newcomer(r) if r in newcomers else survivor(r) for r in range(12)]
    plan = plan_hydration(reports, recovering=True, local_world_size=4)
    assert (plan.source, plan.newcomers) == (source, newcomers)


def test_a_sharded_state_is_always_sent_by_rank_0() -> None:
    reports = [
        survivor(0, sharded=True),
        survivor(1, sharded=True, ready=False),
        survivor(2, sharded=True, ready=False),
        newcomer(3),
    ]
    assert plan_hydration(reports, local_world_size=2).source == 0


def test_without_survivors_the_newest_hand_off_is_the_source() -> None:
    reports = [
        newcomer(0),
        RankReport(
            rank=1,
            survivor=False,
            source_ready=False,
            step=-1,
            structure="s",
            checksum=None,
            sharded=None,
            handoff_step=40,
        ),
        newcomer(2),
    ]
    plan = plan_from_handoff(plan_hydration(reports, recovering=True), reports)
    assert (plan.source, plan.newcomers, plan.handoff, plan.step) == (1, (0, 2), True, 40)
    assert plan_from_handoff(plan_hydration([newcomer(0), newcomer(1)]), [newcomer(0), newcomer(1)]).source is None


def test_the_newest_step_a_rank_knows_counts_its_hand_off_its_snapshots_and_its_kept_shard() -> None:
    """What a start from step 0 would lose is the newest step any report names: a replacement knows none (-1)."""
    assert newcomer(0).newest_step() == -1
    assert survivor(0, step=12).newest_step() == 12
    assert replace(newcomer(1), handoff_step=40).newest_step() == 40
    snapshot = SnapshotReport(round=3, world_size=2, rank=0, live_step=51, replicas=((1, 49),))
    assert replace(newcomer(0), snapshot=snapshot).newest_step() == 51
    assert replace(newcomer(0), holding=Holding(shard_size=2, shard=1, step=33, previous=32)).newest_step() == 33


def test_a_survivor_is_always_preferred_to_a_hand_off() -> None:
    handed = RankReport(
        rank=1, survivor=False, source_ready=False, step=-1, structure="s", checksum=None, sharded=None, handoff_step=50
    )
    reports = [survivor(0, step=51), handed]
    plan = plan_from_handoff(plan_hydration(reports, recovering=True), reports)
    assert (plan.source, plan.handoff, plan.newcomers) == (0, False, (1,))


@pytest.mark.parametrize(
    ("reports", "message"),
    [
        (
            [survivor(0, 10), survivor(1, 11), newcomer(2)],
            r"survivors hold different steps \(rank 0 at step 10, rank 1 at step 11\)",
        ),
        ([survivor(0, checksum="a"), survivor(1, checksum="b")], "survivors' model replicas differ at step 10"),
        ([survivor(0), newcomer(1, structure="other")], "rank 1's model has other parameter names"),
        ([survivor(0, sharded=True), survivor(1)], "some survivors hold a sharded"),
    ],
)
def test_state_that_does_not_agree_is_refused(reports, message) -> None:
    with pytest.raises(StateMismatchError, match=message):
        plan_hydration(reports)


def test_a_repair_takes_the_survivors_at_the_furthest_step_and_brings_the_others_to_it() -> None:
    """A peer died mid-step: rank 1's collectives completed before the death reached rank 0."""
    plan = plan_hydration(
        [survivor(0, 10, checksum="old"), survivor(1, 11, checksum="new"), newcomer(2)], recovering=True
    )
    assert (plan.source, plan.newcomers, plan.survivors, plan.step) == (1, (0, 2), (1,), 11)


def test_a_sharded_model_is_not_repaired_in_place() -> None:
    with pytest.raises(HydrationError, match="shards on the failed rank exist nowhere else"):
        plan_hydration([survivor(0, sharded=True), newcomer(1)], recovering=True)


def test_digests_see_shapes_and_values() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert structure_digest(a) == structure_digest(b) != structure_digest(torch.nn.Linear(2, 3))
    assert value_checksum(a) != value_checksum(b)
    b.load_state_dict(a.state_dict())
    assert value_checksum(a) == value_checksum(b)


def test_optimizer_state_splits_into_a_skeleton_and_tensors() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    skeleton, tensors = split_tensors(opt.state_dict())
    assert isinstance(skeleton["state"][0]["exp_avg"], TensorSpec) and len(tensors) == 6
    rebuilt, empty = allocate_tensors(skeleton, torch.device("cpu"))
    for dst, src in zip(empty, tensors):
        dst.copy_(src)
    other = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    other.load_state_dict(rebuilt)
    assert other.param_groups[0]["lr"] == 0.1
    assert torch.equal(other.state_dict()["state"][1]["exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])


class _FrameworkError(RuntimeError):
    pass


def test_a_failed_collective_becomes_the_callers_error_naming_the_round_and_its_limit() -> None:
    with pytest.raises(
        _FrameworkError,
        match=r"rank 1: bringing round 4's 3 ranks to one state failed or timed out \(limit 30s\): Connection closed by peer",
    ) as caught:
        with collective_failures(_FrameworkError, rank=1, round=4, world_size=3, timeout_s=30):
            raise RuntimeError("Connection closed by peer")
    assert isinstance(caught.value.__cause__, RuntimeError)
    for ours in (HydrationError("no source"), _FrameworkError("already said")):  # our own errors pass unchanged
        with pytest.raises(type(ours)) as passed:
            with collective_failures(_FrameworkError, rank=1, round=4, world_size=3, timeout_s=30):
                raise ours
        assert passed.value is ours


def test_the_checksum_of_a_large_tensor_holds_no_float64_copy_of_it() -> None:
    """A replica's checksum sums in float64 chunk by chunk: a 256 MiB float32 weight costs a few MiB more,
    not the 512 MiB of a full float64 copy (4 GB for Llama-3-8B's embedding on a GPU)."""
    code = """
import resource, torch
from elastic_events.rounds.hydration import value_checksum
m = torch.nn.Linear(8192, 8192, bias=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
first = value_checksum(m)
extra_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
with torch.no_grad():
    m.weight[4000, 17] += 1.0
print(extra_mb, first != value_checksum(m))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    extra_mb, changed = out.stdout.split()
    assert float(extra_mb) < 64 and changed == "True", out.stdout
