"""In-place events on nodes of two ranks each: a whole node joins and leaves, and one rank of a node is
killed while its sibling goes on. Real launchers, real gloo ranks, the in-process API. (The loss of a whole
two-rank node is a case of ``test_in_place.py``'s ``test_a_lost_node_is_repaired_in_place``.)

What a node of several ranks adds to the one-rank cases: the node's ranks move together (a joiner's two
ranks are both hydrated, a leaver's both leave), and a replaced rank is hydrated from its own node's survivor.
"""

from __future__ import annotations

import json
import signal

import psutil
import pytest

from support.cluster import wait_until
from support.in_place import (
    HYDRATED,
    INPLACE,
    assert_trained_like_one_process,
    pid_of_rank,
    ranks_of_node,
    reference_params,
    rescued_ranks,
    worlds,
)


def test_a_two_rank_node_joins_and_leaves_in_place(make_job) -> None:
    """1x2 -> 2x2 -> 1x2: both ranks of b are hydrated from a's at the join and both leave at the leave;
    a's two ranks keep their processes throughout; every step once, the parameters of one process."""
    job = make_job(script=INPLACE, nproc_per_node=2)
    job.start_node("a")
    job.wait_steps(3)
    a_pids = set(ranks_of_node(job, "a").values())
    assert len(a_pids) == 2
    job.start_node("b")
    joined = job.wait_for_world(4, timeout=90)
    b_ranks = ranks_of_node(job, "b")
    job.signal("b", signal.SIGTERM)
    job.wait_for_world(2, after_step=joined, timeout=90)
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))

    records = worlds(job)
    assert {r["pid"] for r in records if r["how"] in ("fresh", "reconfigured")} == a_pids, records  # never restarted
    assert [r["world"] for r in records if r["pid"] in a_pids and r["how"] == "reconfigured"] == [4, 4, 2, 2], records
    peers = [r for r in records if r["how"] == "peers"]
    assert sorted(r["rank"] for r in peers) == sorted(b_ranks) and {r["pid"] for r in peers} == set(b_ranks.values()), (
        records
    )  # b's two ranks, hydrated from a's, not from storage
    assert sorted(r["pid"] for r in records if r["how"] == "left") == sorted(b_ranks.values()), records
    newcomers = [e["newcomers"] for e in job.events("hydrated")]  # rank 0 of each new round says it
    assert newcomers == [2, 0], newcomers  # the join: both of b's ranks new; the leave: none
    targeted = [(e["kind"], e["mode"]) for e in job.events("scale_targeted")]
    assert targeted == [("join", "reconfigure"), ("leave", "reconfigure")], targeted
    in_place = [e for e in job.events("rendezvous_done") if e.get("in_place")]
    assert in_place and all(e["world_size"] == 2 * len(e["members"]) for e in in_place), in_place
    progress = job.progress()
    steps = [p["step"] for p in progress]  # every step once, in order, at 2, 4, 2 ranks
    assert steps == list(range(1, len(steps) + 1))
    sizes = [p["world"] for p in progress]
    assert [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]] == [2, 4, 2]
    final = [json.loads(x) for x in (job.run_dir / "final.jsonl").read_text().splitlines()]
    leave_step = job.events("scale_targeted")[1]["target_step"]
    assert sorted(f["step"] for f in final) == [leave_step, leave_step, steps[-1], steps[-1]], final  # b's, then a's
    reference = reference_params({f["step"] for f in final})
    for f in final:  # every rank's parameters equal an unbroken single-process run at its last step
        for got, want in zip(f["params"], reference[f["step"]], strict=True):
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_failed_rank_of_a_two_rank_node_is_replaced_while_its_sibling_goes_on(make_job, fault) -> None:
    """2x2, kill -9 of one rank, or SIGSTOP (its agent kills it after --hang-timeout while its sibling waits
    for it in a collective): its node's spare takes its place and is hydrated from the sibling on the same
    node (the node's own links); the other three ranks keep their processes."""
    flags = ("--max-restarts", "3", "--spare-ranks", "1", "--hang-timeout", "2")
    job = make_job(script=INPLACE, nnodes="2", flags=flags)
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: len({e["node"] for e in job.events("spare_ready")}) == 2, timeout=90, what="every node's spare")
    job.wait_for_world(4, timeout=90)
    job.wait_steps(3)
    before = {**ranks_of_node(job, "a"), **ranks_of_node(job, "b")}
    assert sorted(before) == [0, 1, 2, 3], before
    victim_rank = 1
    node = "a" if victim_rank in ranks_of_node(job, "a") else "b"
    sibling = next(r for r in ranks_of_node(job, node) if r != victim_rank)
    psutil.Process(before[victim_rank]).send_signal(fault)
    wait_until(lambda: [r for r in worlds(job) if r["how"] in HYDRATED], timeout=60, what="the replacement's hydration")
    job.wait_steps(3)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))

    rescued = rescued_ranks(job)
    assert victim_rank not in rescued and len(rescued) <= 1, rescued
    for rank, pid in before.items():  # the survivors were never restarted
        if rank != victim_rank and rank not in rescued:
            assert pid_of_rank(job, rank) == pid, (rank, worlds(job))
    replacement = [r for r in worlds(job) if r["how"] in HYDRATED and r["rank"] == victim_rank]
    assert len(replacement) == 1 and replacement[0]["pid"] != before[victim_rank], worlds(job)
    assert replacement[0]["pid"] in [e["pid"] for e in job.events("spare_ready") if e["node"] in _node_ids(job, node)]
    if not rescued:  # the source of a replica is the failed rank's own node when a survivor is there
        assert [e["from_rank"] for e in job.events("hydrated")] == [sibling], job.events("hydrated")
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [("rank_failure", "reconfigure")]
    assert [e["rank"] for e in job.events("rank_hung")] == ([victim_rank] if fault == signal.SIGSTOP else [])
    assert_trained_like_one_process(job)


def _node_ids(job, name: str) -> set[str]:
    """The rendezvous node ids of launcher ``name`` (from its agent_started record)."""
    pid = job.nodes[name].pid
    return {e["node"] for e in job.events("agent_started") if e.get("pid") == pid}
