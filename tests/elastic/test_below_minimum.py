"""Below --nnodes MIN the survivors keep the state (rendezvous/hold.py, elastic_events/rounds/hold.py), end to end.

Real launchers and gloo ranks on the in-process API (tests/elastic/scripts/inplace_counter.py). Before:
a leave that left too few nodes saved and stopped every rank (a later node restarted the job from
storage), a lost node stopped them without a save; now the survivor holds the state in memory with
its process, and a node that joins is hydrated from it at the step it held.
"""

from __future__ import annotations

import signal
from pathlib import Path

from support.cluster import wait_until
from support.jsonl import read_jsonl

INPLACE = Path(__file__).resolve().parent / "scripts" / "inplace_counter.py"


def test_a_leave_below_the_minimum_holds_the_state_a_new_node_resumes_it_and_the_holder_leaves_at_once(
    make_job,
) -> None:
    job = make_job(nnodes="2:2", script=INPLACE)
    job.start_node("a")
    job.start_node("b")
    joined = job.wait_for_nodes(2, timeout=120)
    job.wait_steps(3)
    job.signal("b", signal.SIGTERM)  # one node left, below MIN 2: a holds
    assert job.nodes["b"].wait(timeout=90) == 0, job.stderr("b")
    wait_until(lambda: _holds(job, "a") == 1, timeout=60, what="a's rank 0 to hold the state")
    held = job.progress()[-1]["step"]
    assert "too few nodes to train (--nnodes minimum 2)" in job.stderr("a")
    job.start_node("c")
    job.wait_for_nodes(2, after_step=held, timeout=90)
    job.wait_steps(3)

    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1)) and held > joined  # nothing lost, nothing redone
    records = read_jsonl(job.run_dir / "worlds.jsonl")
    survivors = {r["pid"] for r in records if r["how"] == "reconfigured"}  # a's ranks
    assert len(survivors) == job.world(1), records
    # reconfigure() returns once the hold ends: from round 1 through the held round 2 (no step) into 3
    for survivor in survivors:
        assert [(r["world"], r["round"], r["how"]) for r in records if r["pid"] == survivor] == [
            (job.world(2), 1, "fresh"),
            (job.world(2), 3, "reconfigured"),
        ], records
    newcomers = [r for r in records if r["pid"] not in survivors and r["how"] == "peers" and r["step"] == held]
    assert len(newcomers) == job.world(1), records  # c's ranks took the held state from a, at the held step
    assert [(e["kind"], e["mode"]) for e in job.events("scale_targeted")] == [
        ("leave", "reconfigure"),
        ("join", "reconfigure"),
    ]
    assert sum(e["node"] == _node(job, "a") for e in job.events("workers_started")) == 1

    # c leaves too: a holds again; then the last holder gets SIGTERM and leaves at once, exit 0.
    job.signal("c", signal.SIGTERM)
    assert job.nodes["c"].wait(timeout=90) == 0, job.stderr("c")
    wait_until(lambda: _holds(job, "a") == 2, timeout=60, what="a's rank 0 to hold the state again")
    job.signal("a", signal.SIGTERM)
    assert job.nodes["a"].wait(timeout=30) == 0, job.stderr("a")
    assert "left the job gracefully" in job.stderr("a")


def _holds(job, node: str) -> int:
    return (job.run_dir / f"{node}.out").read_text().count("holding step")


def _node(job, name: str) -> str:
    return next(e["node"] for e in job.events("agent_started") if e["pid"] == job.nodes[name].pid)
