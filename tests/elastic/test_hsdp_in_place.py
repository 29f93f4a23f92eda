"""Elastic HSDP under real launchers: nodes of two ranks, a shard group per node, so a node is a replica.

Joins and leaves move whole replicas (a join: one replica's shards, each from the same shard index of a
node that has it; a leave: nothing); a killed rank's shard comes from another replica, so no snapshot
copy is kept while two replicas exist; with one replica left, the in-memory snapshots of FSDP repair it.
"""

from __future__ import annotations

import signal

from support.cluster import wait_until
from support.in_place import (
    INPLACE,
    assert_trained_like_one_process,
    hit_rank_1,
    pid_of_rank,
    rescued_ranks,
    two_nodes_hit_rank_1,
    worlds,
)
from support.jsonl import read_jsonl

#: Rank 1's local state: one row of Linear(4, 2) (weight 4 + bias 1 floats) and SGD's momentum of it.
SHARD_BYTES = (4 + 1) * 4 * 2


def test_a_killed_hsdp_rank_takes_its_shard_from_the_other_replica(make_job, tmp_path) -> None:
    """HSDP, two nodes of two ranks, a shard group per node: both nodes hold every shard, so no snapshot copy is
    kept and a killed rank's replacement takes its shard from the same shard index on the other node."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "hsdp"),
        nnodes="2",
        flags=("--max-restarts", "3"),
        nproc_per_node=2,
    )
    survivor, victim = two_nodes_hit_rank_1(job, signal.SIGKILL, start_timeout=120)

    rescued = rescued_ranks(job)  # gloo now and then misses a dead peer: such a survivor is replaced too
    assert len(rescued) <= 1 and 1 not in rescued, rescued
    records = worlds(job)
    for rank in {0, 2, 3} - set(rescued):  # the survivors: never restarted
        assert [r["how"] for r in records if r["rank"] == rank] == ["fresh", "recovered"], records
    if 0 not in rescued:
        assert {r["pid"] for r in records if r["rank"] == 0} == {survivor}, records
    replacement = [r for r in records if r["rank"] == 1 and r["how"] != "fresh"]
    assert [(r["how"], r["world"]) for r in replacement] == [("peers", 4)] and victim != replacement[0]["pid"]
    # one repair (a node_lost when a survivor's failed collective reached the decider before the agent's crash report)
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] in (
        [("rank_failure", "reconfigure")],
        [("node_lost", "reconfigure")],
    )
    repaired = job.events("hydrated")[-1]
    if not rescued:  # one shard moved, from rank 3 (the same shard index in the other replica)
        assert (repaired["mesh"], repaired["newcomers"], repaired["bytes_moved"]) == ([2, 2], 1, SHARD_BYTES)
    assert not [e for e in job.events() if e["event"].startswith("snapshot")], "two replicas: no snapshot copies"
    assert_trained_like_one_process(job)
    assert {p["world"] for p in job.progress()} == {4}


def test_a_rank_killed_inside_the_cross_replica_reduction_costs_one_step_not_the_run(make_job, tmp_path) -> None:
    """Rank 1 dies as step 6's cross-replica all-reduce starts, after its replica's reduce-scatter: shard 0's
    ranks (0 and 2) complete their all-reduce and apply step 6, rank 3 (shard 1, rank 1's peer) cannot. No rank
    holds every shard at one step, except through the copies each rank keeps one step back: the round goes on
    from step 6's start, step 6 is trained again. Before those copies this started the run again from step 0."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "hsdp", "die-in-reduction-at=6"),
        nnodes="2",
        flags=("--max-restarts", "3"),
        nproc_per_node=2,
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(
        lambda: [r for r in worlds(job) if r["how"] == "peers"] or job.events("state_lost"),
        timeout=120,
        what="rank 1's replacement to be hydrated, or the state to be lost",
    )
    job.wait_steps(5)
    assert job.finish() == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))

    assert not job.events("state_lost"), job.events("state_lost")
    assert [(e["step"], e["redone"]) for e in job.events("step_rolled_back")] == [(6, 1)]
    records = worlds(job)
    assert [(r["how"], r["step"]) for r in records if r["rank"] == 1 and r["how"] != "fresh"] == [("peers", 6)]
    assert {r["how"] for r in records if r["rank"] in (0, 2, 3)} == {"fresh", "recovered"}, records
    assert job.events("hydrated")[-1]["bytes_moved"] == SHARD_BYTES  # shard 1, from rank 3 to the replacement
    assert_trained_like_one_process(job)


def test_a_killed_rank_of_the_only_hsdp_replica_is_restored_from_snapshots(make_job, tmp_path) -> None:
    """HSDP with one replica (one node of two ranks): no other replica holds the shards, so in-memory snapshots
    are taken as for FSDP over the world, and a killed rank's shard comes back from its peer's copy."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "hsdp"),
        nnodes="1",
        flags=("--max-restarts", "3"),
        nproc_per_node=2,
    )
    job.start_node("a")
    wait_until(lambda: job.events("round_in_process"), timeout=120, what="the round to run in-process")
    hit_rank_1(job, signal.SIGKILL)
    assert job.finish() == {"a": 0}, job.stderr("a")
    (restored,) = job.events("snapshot_restored")
    assert not restored["resharded"], restored  # the same 1 x 2 mesh: each shard back to its own rank
    assert job.events("hydrated")[-1]["mesh"] == [1, 2]
    assert_trained_like_one_process(job)


def test_hsdp_nodes_join_and_leave_in_place_as_whole_replicas(make_job, tmp_path) -> None:
    """HSDP, nodes of two ranks: 2 x 2 -> 3 x 2 (c joins: one replica's shards, each from node a's rank of the
    same shard index) -> 2 x 2 (c leaves: nothing moves); no process but c's is started, nothing is lost."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "hsdp"),
        nnodes="2:3",
        nproc_per_node=2,
    )
    job.start_node("a")
    job.start_node("b")
    at_four = job.wait_for_world(4, timeout=120)
    job.start_node("c")
    joined = job.wait_for_world(6, after_step=at_four, timeout=120)
    job.signal("c", signal.SIGTERM)
    job.wait_for_world(4, after_step=joined, timeout=120)
    job.wait_steps(3)
    assert job.finish() == {"a": 0, "b": 0, "c": 0}, [job.stderr(n) for n in "abc"]

    records = worlds(job)
    builds = read_jsonl(job.run_dir / "builds.jsonl")
    for rank in range(4):  # a's and b's ranks: started once, never restarted
        pid = pid_of_rank(job, rank)
        assert [r["how"] for r in records if r["pid"] == pid] == ["fresh", "reconfigured", "reconfigured"]
        # rebuilt on each event's mesh with NaN weights (told the kept state is loaded over them): none is left
        assert [b["loaded_over"] for b in builds if b["pid"] == pid] == [False, True, True]
    assert sorted((r["rank"], r["how"]) for r in records if r["world"] == 6 and r["how"] == "peers") == [
        (4, "peers"),
        (5, "peers"),
    ]
    assert [(e["mesh"], e["newcomers"], e["bytes_moved"]) for e in job.events("hydrated")] == [
        ([3, 2], 2, 2 * SHARD_BYTES),  # one replica: two shards
        ([2, 2], 0, 0),
    ]
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [
        ("join", "reconfigure"),
        ("leave", "reconfigure"),
    ]
    assert not [e for e in job.events() if e["event"].startswith("snapshot")]
    assert_trained_like_one_process(job)


def test_a_lost_hsdp_node_is_repaired_without_moving_a_shard(make_job, tmp_path) -> None:
    """kill -9 of node b (launcher and ranks): node a's ranks hold every shard, so the repaired round (one
    replica) loads what they kept and moves nothing; from then on snapshots cover the last replica."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "hsdp"),
        flags=("--max-restarts", "3"),
        nproc_per_node=2,
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: job.events("round_in_process"), timeout=120, what="the round to run in-process")
    at_four = job.wait_for_world(4, timeout=120)
    survivors = {pid_of_rank(job, 0), pid_of_rank(job, 1)}
    job.kill_node_hard("b")
    job.wait_for_world(2, after_step=at_four, timeout=120)
    job.wait_steps(3)
    assert job.finish()["a"] == 0, job.stderr("a")

    assert {pid_of_rank(job, 0), pid_of_rank(job, 1)} == survivors  # node a's ranks never restarted
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")][-1] == ("node_lost", "reconfigure")
    repaired = job.events("hydrated")[-1]
    assert not job.events("snapshot_restored")
    assert not job.events("state_lost"), job.events("snapshot_unavailable")
    assert (repaired["mesh"], repaired["newcomers"], repaired["bytes_moved"]) == ([1, 2], 0, 0)
    # b may die inside a step's cross-replica reduction that completed for one of a's shards and not the other:
    # the rank ahead then loads its copy one step back (step_rolled_back), and only that step is redone
    assert [e["redone"] for e in job.events("step_rolled_back")] in ([], [1])
    assert_trained_like_one_process(job)
