"""Checkpointless scale events end to end: real launchers, real gloo ranks, the in-process API.

Surviving ranks keep their process (same pid) through a join and a graceful leave; the joiner
is pre-warmed as a standby and hydrated from its peers; no step is lost or redone; the final
parameters equal a single process trained for the same number of steps. Steps are not padded.

Nodes run two ranks each unless a case says why not (``ElasticJob``'s default): a joining node's ranks are
hydrated together and a leaving node's leave together, and a killed or hung rank's replacement is hydrated
from its sibling on the same node while the node's other ranks keep their processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from support.cluster import wait_until
from support.in_place import (
    HYDRATED,
    INPLACE,
    assert_events_reconfigured_in_place,
    assert_trained_like_one_process,
    hit_rank_1,
    pid_of_rank,
    rank_0_rescued,
    ranks_of_node,
    reference_params,
    rescued_ranks,
    script_args,
    two_nodes_hit_rank_1,
    worlds,
)


def test_join_and_leave_in_place_keep_the_survivors_processes(make_job, etcd_endpoint) -> None:
    """etcd: on c10d, the join and the leave are test_a_new_node_joins_in_place_after_another_left's."""
    job = make_job(backend="etcd", endpoint=etcd_endpoint, script=INPLACE)
    job.start_node("a")
    job.wait_steps(5)
    job.start_node("b")
    joined = job.wait_for_nodes(2, timeout=90)
    job.signal("b", signal.SIGTERM)  # b leaves at the next agreed step; a goes on alone, in place
    job.wait_for_nodes(1, after_step=joined, timeout=90)
    job.wait_steps(5)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))

    records = worlds(job)
    survivors = {r["pid"] for r in records if r["how"] == "fresh"}  # node a's ranks, started fresh
    assert [r["how"] for r in records[: job.world(1)]] == ["fresh"] * job.world(1), records
    assert len(survivors) == job.world(1), records  # and nothing else started from scratch
    assert {r["pid"] for r in records if r["how"] == "reconfigured"} == survivors, records  # never restarted
    hows = [(r["world"], r["how"]) for r in records]
    assert hows.count((job.world(2), "peers")) == job.world(1), hows  # b's ranks hydrated from a, not from storage
    assert (job.world(1), "reconfigured") in hows, hows
    assert_events_reconfigured_in_place(job, reconfigures=3)  # a, b at leave; a at join
    assert len(job.events("workers_reconfigured")) >= 3  # a at the join, b admitted, a at the leave
    targeted = [(e["kind"], e["mode"]) for e in job.events("scale_targeted")]
    assert targeted == [("join", "reconfigure"), ("leave", "reconfigure")], targeted  # the event log says the mode
    newcomers = [e["newcomers"] for e in job.events("hydrated")]  # rank 0 of each new round says it
    assert newcomers == [job.world(1), 0], newcomers  # the join: every rank of b new; the leave: none
    left = sorted(r["pid"] for r in records if r["how"] == "left")
    assert left == sorted(r["pid"] for r in records if r["how"] == "peers"), records  # b's ranks, every one, left
    # every step trained exactly once, in order, at the sizes the events say
    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1))
    assert {p["world"] for p in job.progress()} == {job.world(1), job.world(2)}
    final = [json.loads(x) for x in (job.run_dir / "final.jsonl").read_text().splitlines()]
    assert max(f["step"] for f in final) == steps[-1] and len(final) == job.world(
        2
    )  # the survivors, and the leavers at their last step
    reference = reference_params({f["step"] for f in final})
    for f in final:  # both nodes' parameters equal an unbroken single-process run at their step
        for got, want in zip(f["params"], reference[f["step"]]):
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    ("backend_name", "nodes", "spares", "model", "start_method"),
    [
        # the spare, torch already imported, takes the failed rank's place (a spawned spare: the test of a
        # failure while the next spare is still starting)
        pytest.param("c10d", ("a", "b"), 1, "ddp", "forkserver", id="c10d-2nodes-spare-ddp"),
        # a new process is started parked, spawned as the launcher's default start method does
        pytest.param("etcd", ("a", "b"), 0, "ddp", "spawn", id="etcd-2nodes-nospare-ddp"),
        pytest.param("c10d", ("a", "b"), 0, "ddp", "forkserver", id="c10d-2nodes-forked-ddp"),  # ... forked
        pytest.param("c10d", ("a",), 1, "ddp", "forkserver", id="c10d-1node-spare-ddp"),  # 2 ranks on one node
        # a survivor may wait on a live peer: it must let go of the broken group, or be replaced
        pytest.param("c10d", ("a", "b", "c"), 1, "ddp", "forkserver", id="c10d-3nodes-spare-ddp"),
        # the failed rank's shards come back from the snapshot its peer holds
        pytest.param("c10d", ("a", "b"), 1, "fsdp", "forkserver", id="c10d-2nodes-spare-fsdp"),
        # three shards, one of them lost
        pytest.param("etcd", ("a", "b", "c"), 1, "fsdp", "forkserver", id="etcd-3nodes-spare-fsdp"),
    ],
)
def test_a_killed_rank_is_replaced_in_place(
    make_job, backend_name, nodes, spares, model, start_method, request, tmp_path
) -> None:
    """kill -9 of one rank: its node replaces it (its spare, or a new process), parked; the survivors keep
    their processes and state, the replacement is hydrated from them, and no committed step is lost or trained twice.

    Sharded (FSDP2): the failed rank's shards come from the copy its holder keeps (``elastic_events.rounds.snapshot``);
    a step committed after the newest copy is trained again, and only such a step.

    Now and then a survivor never returns from the broken group's collective (gloo misses the failure); it
    hands its state off and its agent replaces it within the same repair. Only that case may replace a
    survivor, and only once; its replacement holds the state (from the hand-off or a peer)."""
    endpoint = request.getfixturevalue("etcd_endpoint") if backend_name == "etcd" else None
    # Two ranks a node (rank 1, the victim, is rank 0's sibling); three nodes of one rank each, so that the
    # ranks and their spares stay within what two cores run in the test's timeouts.
    per_node = 1 if len(nodes) > 2 else 2
    world = per_node * len(nodes)
    job = make_job(
        backend=backend_name,
        endpoint=endpoint,
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        nnodes=str(len(nodes)),
        flags=("--max-restarts", "3", "--spare-ranks", str(spares)),
        start_method=start_method,
        nproc_per_node=per_node,
    )
    for name in nodes:
        job.start_node(name)
    wait_until(lambda: job.events("round_in_process"), timeout=90, what="the round to run in-process")
    if spares:
        wait_until(
            lambda: len({e["node"] for e in job.events("spare_ready")}) == len(nodes),
            timeout=90,
            what="every node's spare",
        )
    survivor, victim = hit_rank_1(job, signal.SIGKILL)
    codes = job.finish()
    assert codes == dict.fromkeys(nodes, 0), [job.stderr(n) for n in nodes]

    rescued = rescued_ranks(job)
    assert len(rescued) <= 1 and 1 not in rescued, rescued
    records = worlds(job)
    for rank in {r["rank"] for r in records} - {1, *rescued}:  # the survivors: never restarted
        assert [r["how"] for r in records if r["rank"] == rank] == ["fresh", "recovered"], records
    if 0 not in rescued:
        assert {r["pid"] for r in records if r["rank"] == 0} == {survivor}, records
    replacement = [r for r in records if r["how"] in HYDRATED]
    assert sorted(r["rank"] for r in replacement) == sorted([1, *rescued]), records
    assert victim not in {r["pid"] for r in replacement} and {r["world"] for r in replacement} == {world}, records
    victim_node = next(e["node"] for e in job.events("worker_failed"))
    spares_there = [e["pid"] for e in job.events("spare_ready") if e["node"] == victim_node]
    took_over = next(r["pid"] for r in replacement if r["rank"] == 1)
    assert (took_over in spares_there) == bool(spares), (replacement, spares_there)  # the spare took its place
    if per_node == 2 and model == "ddp" and not rescued:  # a replica comes from the failed rank's own node
        assert [e["from_rank"] for e in job.events("hydrated")] == [0], job.events("hydrated")  # rank 1's sibling
    failed = job.events("worker_failed")
    assert len(failed) == 1 + len(rescued) and all(
        e["repaired_in_place"] and e["signal"] == "SIGKILL" for e in failed
    ), failed
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [
        ("rank_failure", "reconfigure")
    ]  # one repair
    assert not [e for e in job.events("workers_stopped") if e["event_id"]], "no rank was stopped before the job's end"
    in_place = [e for e in job.events("rendezvous_done") if e.get("in_place")]
    assert {e["reason"] for e in in_place} == {"failure"} and len(in_place) == len(nodes), (
        in_place
    )  # every node, repaired
    assert_trained_like_one_process(job)
    assert {p["world"] for p in job.progress()} == {world}
    if model == "fsdp":  # --snapshot-every auto: each round timed its first snapshots and chose within 2 %
        chosen = job.events("snapshot_interval")
        assert chosen and all(e["every"] >= 1 and e["overhead"] <= e["target"] for e in chosen), chosen
    # sharded: the world is the broken round's, so each shard went back to its own rank, none was gathered
    assert [e["resharded"] for e in job.events("snapshot_restored")] == ([False] if model == "fsdp" else []), (
        job.events("snapshot_restored")
    )


def rank_pids(job, name: str) -> set[int]:
    """The pids of the processes node ``name``'s launcher runs now (its rank, and a standby if any)."""
    return {p.pid for p in psutil.Process(job.nodes[name].pid).children(recursive=True)}


def test_a_new_node_joins_in_place_after_another_left(make_job) -> None:
    """1 → 2 → 1 → 2 nodes: a starts, b joins, b leaves, a new node c joins; every step once, params as unbroken.

    c10d only: etcd's join and leave are test_join_and_leave_in_place_keep_the_survivors_processes's.
    """
    job = make_job(backend="c10d", script=INPLACE)
    job.start_node("a")
    job.wait_steps(3)
    job.start_node("b")
    joined = job.wait_for_nodes(2, timeout=90)
    b_pids = rank_pids(job, "b")
    job.signal("b", signal.SIGTERM)  # b leaves at the next agreed step; a goes on alone, in place
    left = job.wait_for_nodes(1, after_step=joined, timeout=90)
    assert job.nodes["b"].wait(timeout=60) == 0, job.stderr("b")  # b is gone before c arrives
    job.start_node("c")
    job.wait_for_nodes(2, after_step=left, timeout=90)
    c_pids = rank_pids(job, "c")
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0, "c": 0}, (job.stderr("a"), job.stderr("c"))

    node_of_pid = {e["pid"]: e["node"] for e in job.events("agent_started")}
    nodes = {name: node_of_pid[launcher.pid] for name, launcher in job.nodes.items()}
    assert len(set(nodes.values())) == 3, nodes  # c is a new node, not b's id again
    records = worlds(job)
    per_node, one, two = job.nproc_per_node, job.world(1), job.world(2)
    survivors = {r["pid"] for r in records if r["how"] == "fresh"}  # node a's ranks, started fresh, never restarted
    assert len(survivors) == one, records
    for survivor in survivors:
        assert [(r["world"], r["how"]) for r in records if r["pid"] == survivor] == [
            (one, "fresh"),
            (two, "reconfigured"),
            (one, "reconfigured"),
            (two, "reconfigured"),
        ], records
    peers = [r for r in records if r["how"] == "peers"]  # each newcomer hydrated from a, not from storage
    assert [r["world"] for r in peers] == [two] * 2 * per_node, records
    assert {r["pid"] for r in peers[:per_node]} <= b_pids, (records, b_pids)
    assert {r["pid"] for r in peers[per_node:]} <= c_pids, (records, c_pids)
    left = sorted(r["pid"] for r in records if r["how"] == "left")
    assert left == sorted(r["pid"] for r in peers[:per_node]), records  # b's ranks left, once each
    hydrated = [(e["newcomers"], e["from_rank"]) for e in job.events("hydrated")]  # the shrink has no newcomer
    assert hydrated == [(per_node, 0), (0, 0), (per_node, 0)], hydrated
    targeted = job.events("scale_targeted")
    kinds = [(e["kind"], e["mode"]) for e in targeted]
    assert kinds == [("join", "reconfigure"), ("leave", "reconfigure"), ("join", "reconfigure")], kinds
    in_place = assert_events_reconfigured_in_place(job, reconfigures=4)  # a at each event, b at its leave
    assert set(in_place[-1]["members"]) == {nodes["a"], nodes["c"]}, in_place

    progress = job.progress()  # every step trained exactly once, in order, on 1, 2, 1, 2 nodes
    assert [p["step"] for p in progress] == list(range(1, len(progress) + 1))
    changes = [(p["step"], p["world"]) for before, p in zip(progress, progress[1:]) if p["world"] != before["world"]]
    assert progress[0]["world"] == one and [w for _, w in changes] == [two, one, two], changes
    assert [s for s, _ in changes] == [e["target_step"] + 1 for e in targeted], (changes, targeted)  # agreed steps
    final = [json.loads(x) for x in (job.run_dir / "final.jsonl").read_text().splitlines()]
    # b's ranks at its leave step (a rank with no group is rank 0), then a's and c's at the last step
    expected = [(0, targeted[1]["target_step"])] * per_node + [(rank, progress[-1]["step"]) for rank in range(two)]
    assert sorted((f["rank"], f["step"]) for f in final) == sorted(expected), final
    reference = reference_params({f["step"] for f in final})
    for f in final:  # every node's parameters equal an unbroken single-process run at its step
        for got, want in zip(f["params"], reference[f["step"]], strict=True):
            assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("per_node", [1, 2], ids=["1rank", "2ranks"])
@pytest.mark.parametrize("model", ["ddp", "fsdp"])
def test_a_lost_node_is_repaired_in_place(make_job, model, per_node, tmp_path) -> None:
    """kill -9 of a whole node (launcher and ranks): the survivors re-form the group without it, in place,
    without waiting for its lease, from their own state (sharded: and the copies of the lost node's shards
    they hold). A node of two ranks takes two ranks and their shards with it at once (4 shards -> 2)."""
    job = make_job(
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        flags=("--max-restarts", "3"),
        nproc_per_node=per_node,
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: job.events("round_in_process"), timeout=90, what="the round to run in-process")
    at_full = job.wait_for_nodes(2)
    job.wait_steps(3)
    survivors = set(ranks_of_node(job, "a").values())
    assert len(survivors) == per_node, survivors
    job.kill_node_hard("b")
    job.wait_for_nodes(1, after_step=at_full, timeout=60)
    job.wait_steps(5)
    codes = job.finish()
    assert codes["a"] == 0, job.stderr("a")

    records = worlds(job)
    repaired = [r for r in records if r["how"] in ("recovered", "handoff") and r["world"] == per_node]
    assert sorted(r["rank"] for r in repaired) == list(range(per_node)), records
    handed = [r for r in repaired if r["how"] == "handoff"]  # a survivor that never returned from the broken group
    assert len(handed) == len(rescued_ranks(job)) <= 1, (records, job.events("ranks_replaced"))
    recovered = {r["pid"] for r in repaired if r["how"] == "recovered"}
    assert recovered <= survivors and len(recovered) == per_node - len(handed), (
        records
    )  # a's ranks kept their processes
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")][-1] == ("node_lost", "reconfigure")
    restored = job.events("snapshot_restored")
    assert [e["resharded"] for e in restored] == ([True] if model == "fsdp" else []), restored  # shards: 2 -> 1, 4 -> 2
    assert_trained_like_one_process(job)


def test_a_repair_with_no_state_left_starts_again_from_step_0(make_job, tmp_path) -> None:
    """FSDP2 on 3 nodes without checkpoints; two nodes are lost at once, so node a holds its own shard and one
    peer's copy but not the third shard: no complete state exists anywhere. The repaired round starts again
    from step 0 with the model built fresh and step 0's data, says so (``state_lost``), and ends on an
    unbroken run's parameters; it never trains new weights under the lost step's count."""
    job = make_job(  # one rank a node: each node holds one shard and its ring neighbour's copy
        script=INPLACE,
        script_args=script_args("fsdp", tmp_path),
        nnodes="1:3",
        flags=("--max-restarts", "3"),
        nproc_per_node=1,
    )
    for name in ("a", "b", "c"):
        job.start_node(name)
    wait_until(lambda: job.events("round_in_process"), timeout=90, what="the round to run in-process")
    job.wait_for_world(3, timeout=90)
    job.wait_steps(5)
    job.kill_node_hard("b")
    job.kill_node_hard("c")
    wait_until(lambda: job.events("state_lost"), timeout=60, what="the repair to find no complete state")
    job.wait_steps(3)
    codes = job.finish()
    assert codes["a"] == 0, job.stderr("a")

    (lost,) = job.events("state_lost")
    steps = [p["step"] for p in job.progress()]
    # the new start's first step (a late node's join may have restarted the job from step 0 before it ran in-process)
    at = len(steps) - 1 - steps[::-1].index(1)
    lost_at = steps[at - 1]
    assert steps[at - lost_at : at] == list(range(1, lost_at + 1)), steps
    assert steps[at:] == list(range(1, len(steps) - at + 1)), steps
    assert lost["lost_steps"] in (lost_at, lost_at + 1), (
        lost,
        steps,
    )  # a peer may have finished a step rank 0 had not logged
    assert "training starts again from step 0" in job.stderr("a")
    assert job.events("snapshot_unavailable") and not job.events("snapshot_restored")
    assert [p["world"] for p in job.progress()][at:] == [1] * (len(steps) - at)  # node a alone, in place
    final = [json.loads(x) for x in (job.run_dir / "final.jsonl").read_text().splitlines()]
    reference = reference_params({steps[-1]})[steps[-1]]
    assert {f["step"] for f in final} == {steps[-1]}, final
    for f in final:  # the weights trained since the new start only
        for got, want in zip(f["params"], reference, strict=True):
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("model", ["ddp", "fsdp"])
def test_a_hung_rank_is_killed_and_replaced_in_place(make_job, model, tmp_path) -> None:
    """SIGSTOP of one rank: its agent dumps the stacks and kills it after --hang-timeout, the peer
    waiting for it (in a collective, or for its snapshot) is not taken for hung, and the job is repaired in place."""
    job = make_job(
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        nnodes="2",
        flags=("--max-restarts", "3", "--hang-timeout", "2"),
    )
    survivor, _ = two_nodes_hit_rank_1(job, signal.SIGSTOP)

    hung = job.events("rank_hung")
    assert [e["rank"] for e in hung] == [1], hung  # the culprit only, not the rank waiting for it
    assert (
        "(most recent call first)" in Path(hung[0]["log_file"]).read_text()
    )  # its Python stacks, dumped before the kill
    assert {r["pid"] for r in worlds(job) if r["rank"] == 0} == {survivor}
    if model == "ddp" and not rescued_ranks(job):  # rank 1's replacement: hydrated from its sibling on its node
        assert [e["from_rank"] for e in job.events("hydrated")] == [0], job.events("hydrated")
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [("rank_failure", "reconfigure")]
    assert_trained_like_one_process(job)


def _block_rank_0_and_kill_rank_1(job) -> dict:
    """Both nodes up with their spares and training; rank 0 blocks for good, then rank 1 is killed. Returns
    rank 0's ``blocked.jsonl`` record (its pid and step)."""
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: len({e["node"] for e in job.events("spare_ready")}) == 2, timeout=90, what="every node's spare")
    job.wait_steps(5)
    (job.run_dir / "block").touch()
    blocked_file = job.run_dir / "blocked.jsonl"
    wait_until(lambda: blocked_file.exists() and blocked_file.read_text().strip(), timeout=30, what="rank 0 to block")
    blocked = json.loads(blocked_file.read_text().splitlines()[0])
    (job.run_dir / "block").unlink()  # its replacement, which may start afresh, must not block too
    os.kill(pid_of_rank(job, 1), signal.SIGKILL)
    return blocked


@pytest.mark.parametrize("model", ["ddp", "fsdp", "hsdp"])
def test_a_survivor_that_never_returns_hands_its_state_to_its_replacement(make_job, model, tmp_path) -> None:
    """Rank 0, the only holder of the state once rank 1 is killed, never returns from its step (as when gloo
    misses its peer's death): its repair watch hands its state off in node-local memory, its agent replaces it
    at once, and the replacement is the source of the repaired round: nothing is lost. A replicated model
    hands its whole state; a sharded one its own shard with the copies of rank 1's its snapshots held (FSDP,
    which trains again the steps after the newest copy), or its shard and that shard one step back (HSDP of
    two one-rank replicas: the killed rank was the other replica)."""
    job = make_job(
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        nnodes="2",
        flags=("--max-restarts", "3", "--spare-ranks", "1"),
        nproc_per_node=1,  # rank 0 is then the only holder of the state, and (HSDP) rank 1 the other replica
    )
    blocked = _block_rank_0_and_kill_rank_1(job)
    wait_until(
        lambda: [r for r in worlds(job) if r["how"] == "handoff"],
        timeout=60,
        what="rank 0's replacement to take the hand-off",
    )
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    records = worlds(job)
    handed = [r for r in records if r["how"] == "handoff"]
    restored = job.events("snapshot_restored")
    redone = [e["redone"] for e in restored]
    assert len(redone) == (model == "fsdp"), restored  # FSDP: from the snapshots, at their newest common step
    assert [(r["rank"], r["step"]) for r in handed] == [(0, blocked["step"] - sum(redone))], records
    repaired = {r["rank"]: r["how"] for r in records if r["round"] == handed[0]["round"]}
    assert repaired == {0: "handoff", 1: "snapshot" if model == "fsdp" else "peers"}, records
    assert blocked["pid"] not in {r["pid"] for r in handed}
    assert not job.events("state_lost"), job.events("snapshot_unavailable")
    assert rescued_ranks(job) == [0], job.events("ranks_replaced")
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [
        ("rank_failure", "reconfigure")
    ]  # one repair
    assert_trained_like_one_process(job)


def test_when_every_rank_is_replaced_with_nothing_handed_off_the_restart_from_step_0_is_said(
    make_job, tmp_path
) -> None:
    """FSDP without snapshots: the blocked rank 0 has no piece that completes the state (rank 1's shard is
    nowhere else), so it hands nothing off, and both ranks of the repaired round are replacements. No rank of
    that round knows the step trained to; the start from step 0 is still said (``state_lost``, rank 0's line)."""
    job = make_job(
        script=INPLACE,
        script_args=script_args("fsdp", tmp_path),
        nnodes="2",
        flags=("--max-restarts", "3", "--spare-ranks", "1", "--snapshot-every", "0"),
        nproc_per_node=1,  # two shards, rank 1's held by no one else
    )
    blocked = _block_rank_0_and_kill_rank_1(job)
    wait_until(lambda: job.events("state_lost"), timeout=60, what="the repair to say the state is lost")
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    assert [e["lost_steps"] for e in job.events("state_lost")] == [None]
    assert "training starts again from step 0 (the steps trained so far are lost" in job.stderr("a")
    assert rescued_ranks(job) == [0], job.events("ranks_replaced")
    records = worlds(job)
    assert blocked["pid"] not in {r["pid"] for r in records if r["round"] > 1}
    assert not [r for r in records if r["how"] == "handoff"], records
    steps = [p["step"] for p in job.progress()]
    assert steps.count(1) == 2 and steps[steps.index(1, 1) - 1] >= 5, steps  # trained to past step 5, then from 1 again
    assert_trained_like_one_process(job)


@pytest.mark.parametrize("model", ["ddp", "fsdp"])
def test_two_failures_in_a_row_are_each_repaired_in_place(make_job, model, tmp_path) -> None:
    """The spare takes the first failed rank's place, and the second one's is taken by a new spare or, when
    none is ready yet, a new process. Each repair counts against --max-restarts; nothing is lost."""
    job = make_job(
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        nnodes="2",
        flags=("--max-restarts", "2", "--spare-ranks", "1"),
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: len({e["node"] for e in job.events("spare_ready")}) == 2, timeout=90, what="every node's spare")
    survivor = pid_of_rank(job, 0)
    for n in (1, 2):
        victim = pid_of_rank(job, 1)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda n=n: len([r for r in worlds(job) if r["how"] in HYDRATED]) >= n, timeout=60, what=f"repair {n}"
        )
        job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    rank_0_rescued(job, survivor)
    assert [e["kind"] for e in job.events("scale_targeted")] == ["rank_failure", "rank_failure"]
    assert len({r["pid"] for r in worlds(job) if r["rank"] == 1}) == 3  # the first rank and its two replacements
    assert_trained_like_one_process(job)


def test_a_failure_while_the_next_spare_is_still_starting_is_repaired_by_that_spare(make_job, tmp_path) -> None:
    """The first repair takes the ready spare and the agent starts the next one; rank 1 is killed again while
    that one is still importing torch. It takes the place anyway (it is further along than a new process,
    which would also compete with it for the CPU); nothing is lost. Fresh processes: a spare forked from the
    node's fork server has nothing left to import."""
    job = make_job(
        start_method="spawn",
        script=INPLACE,
        script_args=script_args("ddp", tmp_path),
        nnodes="2",
        flags=("--max-restarts", "2", "--spare-ranks", "1"),
        nproc_per_node=1,  # rank 1 on node b; fresh processes of two ranks a node would crowd the spare's import
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: len({e["node"] for e in job.events("spare_ready")}) == 2, timeout=90, what="every node's spare")
    job.wait_steps(3)
    os.kill(pid_of_rank(job, 1), signal.SIGKILL)
    (first,) = wait_until(lambda: job.events("ranks_replaced"), timeout=60, what="the first replacement")
    replacement = first["pids"][0]
    agent = psutil.Process(job.nodes["b"].pid)

    def next_spare() -> int | None:
        for proc in agent.children(recursive=True):
            try:
                if proc.pid != replacement and "elastic_events.rounds.spare" in proc.cmdline():
                    return proc.pid
            except psutil.Error:
                continue
        return None

    spare = wait_until(next_spare, timeout=60, what="node b's next spare process")
    os.kill(replacement, signal.SIGKILL)
    wait_until(
        lambda: len([r for r in worlds(job) if r["rank"] == 1 and r["how"] in HYDRATED]) == 2,
        timeout=60,
        what="repair 2",
    )
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    second = job.events("ranks_replaced")[1]
    parked = [e["ts"] for e in job.events("spare_ready") if e["pid"] == spare]
    assert not parked or parked[0] > second["ts"], "the spare was parked before the kill: nothing tested"
    assert second["pids"] == [spare], (second, spare)  # not a new process
    assert [r["pid"] for r in worlds(job) if r["rank"] == 1][-1] == spare
    assert_trained_like_one_process(job)


def test_a_rank_that_dies_while_sending_its_snapshot_is_restored_from_the_one_before(make_job, tmp_path) -> None:
    """Sharded: rank 1 is killed half-way through sending its snapshot of step 40 (its holder's copy of it is
    torn). Its holder still has its complete copy of step 39, and rank 0 its own copy of 39: the job goes
    back to step 39, trains step 40 again, and ends on the parameters of an unbroken run."""
    job = make_job(
        script=INPLACE,
        script_args=(str(tmp_path), "fsdp", "die-sending-at=40"),
        nnodes="2",
        flags=("--max-restarts", "3", "--snapshot-every", "1"),
        nproc_per_node=1,  # rank 1's only holder is rank 0, whose copy of step 40 it tears
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: [r for r in worlds(job) if r["how"] in HYDRATED], timeout=90, what="rank 1's replacement")
    job.wait_steps(5)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    (restored,) = job.events("snapshot_restored")
    assert (restored["step"], restored["redone"], restored["from_live"]) == (39, 1, 0), restored  # two copies of 39
    assert not restored["resharded"], restored  # the same world: each copy went to its own rank, none gathered
    failed = job.events("worker_failed")
    assert [e["signal"] for e in failed] == ["SIGKILL"], (failed, job.events("ranks_replaced"), job.events("rank_hung"))
    assert 40 in [p["step"] for p in job.progress()][40:], "step 40 was trained again"
    assert_trained_like_one_process(job)


# Each moment once and each model once: what the moment changes is the agent's event in flight, what the model
# changes is the state the spare is hydrated with; neither depends on the other.
@pytest.mark.parametrize(("moment", "model"), [("scale_decided", "fsdp"), ("scale_targeted", "ddp")])
def test_a_rank_killed_while_a_join_is_pending_is_repaired_with_the_join(make_job, model, moment, tmp_path) -> None:
    """kill -9 of a rank while node c's join is pending (decided and waiting for c's ranks to park, or targeted
    at a step the ranks have not reached): the survivors' failed collective takes them into the join's group,
    its node's spare takes its place there, c is admitted, and nothing committed is lost."""
    job = make_job(
        script=INPLACE,
        script_args=script_args(model, tmp_path),
        nnodes="1:3",
        flags=("--max-restarts", "3", "--spare-ranks", "1"),
        nproc_per_node=1,  # three nodes and their spares: one rank each stays within two cores
    )
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: job.events("round_in_process"), timeout=90, what="the round to run in-process")
    wait_until(lambda: len({e["node"] for e in job.events("spare_ready")}) == 2, timeout=90, what="every node's spare")
    job.wait_steps(3)
    survivor, victim = pid_of_rank(job, 0), pid_of_rank(job, 1)
    c_started = time.time()
    job.start_node("c")
    wait_until(lambda: [e for e in job.events(moment) if e["kind"] == "join"], timeout=60, what=f"the join's {moment}")
    os.kill(victim, signal.SIGKILL)
    job.wait_for_world(3, timeout=90)
    job.wait_steps(5)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0, "c": 0}, [job.stderr(n) for n in "abc"]

    records = worlds(job)
    assert {r["pid"] for r in records if r["rank"] == 0} == {survivor}, records  # never restarted
    assert victim not in {r["pid"] for r in records if r["world"] == 3}, records
    assert not [e for e in job.events("workers_stopped") if e["event_id"]], "no rank was stopped: nothing restarted"
    assert [e["signal"] for e in job.events("worker_failed")] == ["SIGKILL"]
    assert_trained_like_one_process(job)
    # from c's start on, the job trained at 2 ranks, then 3: the repair never shrank it (before, a may have
    # trained alone for a while, when b's launcher came after the first round's last call)
    assert {p["world"] for p in job.progress() if p["ts"] > c_started} <= {2, 3}, job.progress()
    assert job.progress()[-1]["world"] == 3


#: Rank 1's local state: one row of Linear(4, 2) (weight 4 + bias 1 floats) and SGD's momentum of it.
