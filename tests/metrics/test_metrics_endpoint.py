"""The metrics endpoint of a real launcher, scraped while its job grows from 1 to 2 nodes."""

from __future__ import annotations

import socket

import pytest

from support.cluster import wait_until
from support.launch import SCRIPTS, hyperpodrun_cmd, run
from support.ports import free_port
from support.prom import scrape, value

pytestmark = pytest.mark.slow


def test_metrics_move_as_the_event_log_says(make_job) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    job = make_job(nnodes="1:2")
    job.start_node("a", "--metrics-port", str(port))
    job.wait_for_nodes(1)

    def stepping():
        s = scrape(url)
        return s if value(s, "hyperpodrun_rank_step_rate", local_rank="0") else None

    before = wait_until(stepping, timeout=30, what="the agent to report its rank's step rate")
    assert value(before, "hyperpodrun_world_size") == job.world(1)
    assert value(before, "hyperpodrun_members") == 1
    assert value(before, "hyperpodrun_rank_step_rate", local_rank="0") > 0
    assert value(before, "hyperpodrun_store_request_seconds_count", op="put") >= 1  # the rendezvous wrote its node

    job.start_node("b")
    worlds = []  # world size at each scrape during the event, until the new round has trained a step

    def grown():
        s = scrape(url)
        worlds.append(value(s, "hyperpodrun_world_size"))
        return s if value(s, "hyperpodrun_scale_downtime_seconds_count", kind="join") else None

    after = wait_until(grown, timeout=90, what="the scale event's downtime to be observed", interval=0.05)
    job.wait_steps(3)
    assert job.finish() == {"a": 0, "b": 0}

    assert worlds[0] == job.world(1) and worlds[-1] == job.world(2) and worlds == sorted(worlds)  # it moved once, up
    a = next(e["node"] for e in job.events("agent_started") if e["pid"] == job.nodes["a"].pid)
    mine = [e for e in job.events() if e["node"] == a]
    last_round = [e for e in mine if e["event"] == "rendezvous_done"][-1]
    assert value(after, "hyperpodrun_round") == last_round["round"]
    assert value(after, "hyperpodrun_world_size") == last_round["world_size"] == job.world(2)
    assert value(after, "hyperpodrun_members") == len(last_round["members"]) == 2
    decided = [e for e in mine if e["event"] == "scale_decided"]
    assert value(after, "hyperpodrun_scale_events_total", kind="join", mode="restart") == (len(decided) or None)
    assert value(after, "hyperpodrun_restarts_total", reason="scale") == 1
    # downtime: from this agent's first record of the event to the trainer's first step of the new round
    start = decided[0] if decided else next(e for e in mine if e["event"] == "workers_signalled")
    first = next(e for e in job.events("first_step") if e["round"] == last_round["round"])
    assert value(after, "hyperpodrun_scale_downtime_seconds_sum", kind="join") == pytest.approx(
        first["ts"] - start["ts"]
    )
    stopped = next(e for e in mine if e["event"] == "workers_stopped")
    signalled = next(e for e in mine if e["event"] == "workers_signalled")
    assert value(after, "hyperpodrun_scale_phase_seconds_count", phase="workers_stopped") == 1
    assert not job.events("checkpoint_saved")  # this trainer logs no save: the phase runs from the signal
    assert value(after, "hyperpodrun_scale_phase_seconds_sum", phase="workers_stopped") == pytest.approx(
        stopped["ts"] - signalled["ts"]
    )


def test_metrics_port_in_use_is_one_line_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(
            hyperpodrun_cmd("--standalone", "--metrics-port", str(port), str(SCRIPTS / "allreduce.py")), timeout=60
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hyperpodrun: error: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
