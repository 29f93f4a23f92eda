"""Elastic jobs end to end: real launchers, real stores (embedded and etcd), real gloo ranks, two per node.

The trainer (scripts/counter.py) all-reduces its step every step, so a run that
continues at the right step with the right world size proves the ranks left at
the same agreed step and resumed from exactly the state they saved.
"""

from __future__ import annotations

import signal

from support.cluster import wait_until


def _resume_steps(job) -> list[tuple[int, int]]:
    """(world size, first step) of every training phase, from the trainer's progress file."""
    phases: list[tuple[int, int]] = []
    last_step = 0
    for p in job.progress():
        if not phases or p["world"] != phases[-1][0] or p["step"] <= last_step:
            phases.append((p["world"], p["step"]))
        last_step = p["step"]
    return phases


def _node_id(job, name: str) -> str:
    pid = job.nodes[name].pid
    return next(e["node"] for e in job.events("agent_started") if e["pid"] == pid)


def _steps_are_contiguous(job) -> None:
    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1)), "a step was lost or repeated across a scale event"


def test_scale_up_when_a_node_joins(make_job, backend) -> None:
    name, endpoint = backend
    job = make_job(backend=name, endpoint=endpoint, nnodes="1:2")
    job.start_node("a")
    job.wait_for_nodes(1)
    job.start_node("b")
    job.wait_for_nodes(2)
    job.wait_steps(5)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, job.stderr("a") + job.stderr("b")
    assert [w for w, _ in _resume_steps(job)] == [job.world(1), job.world(2)]
    _steps_are_contiguous(job)  # the cooperative save lost no step
    started = job.events("workers_started")
    assert [e["reason"] for e in started if e["node"] == started[0]["node"]] == ["start", "scale"]
    assert all(e["restart_count"] == 0 for e in started)
    signalled = job.events("workers_signalled")
    assert signalled and all(e["target_step"] > max(e["steps"]) for e in signalled if "target_step" in e)
    assert len(job.events("job_succeeded")) == 1
    # the trainer's own record of each round's first step, for downtime measurements
    assert [(e["world_size"], e["reason"], e["source"]) for e in job.events("first_step")] == [
        (job.world(1), "start", "trainer"),
        (job.world(2), "scale", "trainer"),
    ]


def test_graceful_leave_shrinks_without_losing_a_step(make_job) -> None:
    job = make_job(nnodes="1:2", flags=("--scaling-timeout", "5"))  # wait for b before starting
    job.start_node("a")
    job.start_node("b")
    job.wait_for_nodes(2)
    job.signal("b", signal.SIGTERM)  # preemption of node b
    assert job.nodes["b"].wait(timeout=60) == 0
    assert "left the job gracefully" in job.stderr("b")
    step = job.wait_for_nodes(1)
    job.wait_steps(3)
    assert job.finish() == {"a": 0, "b": 0}
    assert [w for w, _ in _resume_steps(job)] == [job.world(2), job.world(1)]
    _steps_are_contiguous(job)
    restarted = [e for e in job.events("workers_started") if e["world_size"] == job.world(1)]
    assert restarted and restarted[0]["reason"] == "scale" and restarted[0]["restart_count"] == 0
    assert step > 1


def test_lost_node_stops_survivors_and_continues_smaller(make_job, backend) -> None:
    name, endpoint = backend
    job = make_job(backend=name, endpoint=endpoint, nnodes="1:2", flags=("--scaling-timeout", "5"))
    job.start_node("a")
    job.start_node("b")
    job.wait_for_nodes(2)
    job.wait_steps(3)
    job.kill_node_hard("b")  # kill -9 of the launcher and its ranks
    job.wait_for_nodes(1, timeout=90)
    job.wait_steps(3)
    assert job.finish()["a"] == 0, job.stderr("a")
    # survivors resumed from the last saved state (here: the start), not hung in a collective
    worlds = [w for w, _ in _resume_steps(job)]
    assert worlds[0] == job.world(2) and worlds[-1] == job.world(1)
    restarted = [e for e in job.events("workers_started") if e["world_size"] == job.world(1)]
    # collateral damage of the lost node (a survivor's rank may crash first): no failure restart is counted
    assert restarted[0]["reason"] == "failure" and restarted[0]["restart_count"] == 0
    decided = [e for e in job.events("scale_decided") if e["mode"] == "stop"]
    assert decided and {e["kind"] for e in decided} <= {"node_lost", "rank_failure"}


def test_standby_waits_then_replaces_a_leaving_node(make_job) -> None:
    job = make_job(nnodes="2:2")
    job.start_node("a")
    job.start_node("b")
    job.wait_for_nodes(2)
    job.start_node("c")  # a third node: more than the policy allows, waits as a standby
    job.wait_steps(10)
    assert [w for w, _ in _resume_steps(job)] == [job.world(2)]
    job.signal("b", signal.SIGTERM)
    assert job.nodes["b"].wait(timeout=60) == 0
    wait_until(
        lambda: any(e["node"] == _node_id(job, "c") for e in job.events("workers_started")),
        timeout=60,
        what="the standby c to start ranks after b left",
    )
    job.wait_steps(3)
    assert job.finish() == {"a": 0, "b": 0, "c": 0}
    assert [w for w, _ in _resume_steps(job)] == [job.world(2)]  # c took b's place: the size stayed 2...
    _steps_are_contiguous(job)  # ...and the handover lost no step
    rounds = {e["round"]: e["members"] for e in job.events("rendezvous_done")}
    a, b, c = (_node_id(job, n) for n in "abc")
    assert list(rounds.values())[0] == [a, b] and rounds[max(rounds)] == [a, c]  # a stays rank 0


def test_rank_failure_restarts_the_job_and_counts(make_job, tmp_path) -> None:
    script = tmp_path / "fail_once.py"
    script.write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and dist.get_rank() == dist.get_world_size() - 1:\n"
        "    sys.exit(3)\n"
        "print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['HYPERPODRUN_RESTART_REASON'], flush=True)\n"
        "dist.barrier()\n"
    )
    job = make_job(nnodes="2:2", flags=("--max-restarts", "1"), script=script, script_args=())
    job.start_node("a")
    job.start_node("b")
    codes = {n: p.wait(timeout=120) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a") + job.stderr("b")
    out = (job.run_dir / "a.out").read_text() + (job.run_dir / "b.out").read_text()
    assert out.count("attempt 1 failure") == job.world(2)  # every rank of both nodes restarted once
    started = job.events("workers_started")
    assert sorted(e["restart_count"] for e in started) == [0, 0, 1, 1]


def test_rank_failure_without_restarts_fails_the_job_on_every_node(make_job, tmp_path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "sys.exit(4 if dist.get_rank() == 0 else 0)\n"
    )
    job = make_job(nnodes="2:2", script=script, script_args=())
    job.start_node("a")
    job.start_node("b")
    codes = {n: p.wait(timeout=120) for n, p in job.nodes.items()}
    assert codes == {"a": 1, "b": 1}
    for n in ("a", "b"):
        assert "exited with code 4" in job.stderr(n).strip().splitlines()[-1]
