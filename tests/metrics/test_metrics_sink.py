"""AgentMetrics as an event-log sink, fed synthetic records; the store wrapper; the endpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from hyperpodrun.events import EventLog
from hyperpodrun.metrics import AgentMetrics, MetricsError, TrainerRecords, serve
from hyperpodrun.store import EmbeddedStoreServer, StoreError, create_store
from hyperpodrun.store.auth import new_secret
from support.prom import parse, scrape, value


def _values(metrics: AgentMetrics) -> dict:
    return parse(generate_latest(metrics.registry).decode())


def _scale_event(log: EventLog, t0: float, *, kind: str = "join", new_round: int = 2, world: int = 2) -> None:
    """One event's phase records as an agent and its trainer log them, 1 s .. 8 s after t0."""
    log.emit("scale_decided", ts=t0, kind=kind, mode="restart", reason="node joined", event_id=1)
    log.emit("scale_targeted", ts=t0, kind=kind, mode="restart", event_id=1, target_step=40)  # the mode is settled
    for dt, phase in enumerate(("workers_signalled", "checkpoint_saved", "workers_stopped"), start=1):
        log.emit(phase, ts=t0 + dt)
    log.emit("rendezvous_done", ts=t0 + 4, round=new_round, world_size=world, members=["a", "b"])
    log.emit("workers_started", ts=t0 + 5, round=new_round, world_size=world, reason="scale")
    log.emit("checkpoint_loaded", ts=t0 + 7, round=new_round, world_size=world)
    log.emit("first_step", ts=t0 + 8, round=new_round, world_size=world)


@pytest.fixture
def fed() -> tuple[AgentMetrics, EventLog]:
    metrics = AgentMetrics()
    clock = iter(range(10_000))
    log = EventLog(None, job="j", node="a", clock=lambda: float(next(clock)), sink=metrics)

    def emit(event, ts=None, **fields):  # records with the ts a test chooses
        return (
            EventLog.emit(log, event, **fields)
            if ts is None
            else metrics({"ts": ts, "event": event, "round": log.round, "world_size": log.world_size, **fields})
        )

    log.emit = emit  # type: ignore[method-assign]
    return metrics, log


def test_round_world_size_and_members_follow_rendezvous(fed) -> None:
    metrics, log = fed
    log.emit("rendezvous_done", round=1, world_size=4, members=["a", "b"], standbys=["c"])
    v = _values(metrics)
    assert value(v, "hyperpodrun_round") == 1
    assert value(v, "hyperpodrun_world_size") == 4
    assert value(v, "hyperpodrun_members") == 2
    assert value(v, "hyperpodrun_standbys") == 1


def test_scale_event_counts_downtime_and_phases(fed) -> None:
    metrics, log = fed
    _scale_event(log, 100.0)
    v = _values(metrics)
    assert value(v, "hyperpodrun_scale_events_total", kind="join", mode="restart") == 1
    assert value(v, "hyperpodrun_scale_downtime_seconds_count", kind="join") == 1
    assert value(v, "hyperpodrun_scale_downtime_seconds_sum", kind="join") == 8.0
    expected = {
        "workers_signalled": 1,
        "checkpoint_saved": 1,
        "workers_stopped": 1,
        "rendezvous_done": 1,
        "workers_started": 1,
        "checkpoint_loaded": 2,
        "first_step": 1,
    }
    for phase, seconds in expected.items():
        assert value(v, "hyperpodrun_scale_phase_seconds_sum", phase=phase) == seconds, phase
    assert value(v, "hyperpodrun_restarts_total", reason="scale") == 1
    assert value(v, "hyperpodrun_world_size") == 2 and value(v, "hyperpodrun_round") == 2


def test_event_decided_elsewhere_is_timed_from_the_signal(fed) -> None:
    metrics, log = fed
    log.emit("workers_signalled", ts=10.0, event_id=3, event_kind="join", target_step=40)
    log.emit("workers_stopped", ts=12.0)
    log.emit("first_step", ts=15.0, round=1)
    v = _values(metrics)
    assert value(v, "hyperpodrun_scale_events_total", kind="join", mode="restart") is None  # not decided here
    assert value(v, "hyperpodrun_scale_downtime_seconds_sum", kind="join") == 5.0


def test_late_first_step_of_the_old_round_does_not_end_the_event(fed) -> None:
    metrics, log = fed
    log.round = 3
    log.emit("scale_decided", ts=50.0, kind="join", round=3)
    log.emit("first_step", ts=50.5, round=3)  # the previous round's, read late from the file
    assert value(_values(metrics), "hyperpodrun_scale_downtime_seconds_count", kind="join") is None  # nothing observed
    log.emit("first_step", ts=54.0, round=4)
    assert value(_values(metrics), "hyperpodrun_scale_downtime_seconds_sum", kind="join") == 4.0


def test_stop_counts_steps_lost_since_the_last_checkpoint(fed) -> None:
    metrics, log = fed
    log.emit("workers_started", round=1, reason="start")
    metrics.observe_progress((10, 10), (0.1, 0.1))
    log.emit("checkpoint_saved", round=1)
    metrics.observe_progress((17, 16), (0.1, 0.1))
    log.emit("scale_decided", kind="node_lost", mode="stop", reason="node lost")
    log.emit("node_lost")
    log.emit("worker_failed")
    log.emit("store_lost")
    v = _values(metrics)
    assert value(v, "hyperpodrun_steps_lost_total") == 7
    assert value(v, "hyperpodrun_scale_events_total", kind="node_lost", mode="stop") == 1
    assert value(v, "hyperpodrun_nodes_lost_total") == 1
    assert value(v, "hyperpodrun_worker_failures_total") == 1
    assert value(v, "hyperpodrun_store_lost_total") == 1


def test_a_failure_repaired_in_place_counts_the_replaced_ranks_and_no_restart(fed) -> None:
    metrics, log = fed
    log.emit("workers_started", round=1, reason="start")
    log.emit("worker_failed", repaired_in_place=True)
    log.emit("ranks_replaced", ranks=[3, 5], pids=[101, 102])
    log.emit("scale_targeted", kind="rank_failure", mode="reconfigure", target_step=0)
    v = _values(metrics)
    assert value(v, "hyperpodrun_ranks_replaced_total") == 2
    assert value(v, "hyperpodrun_scale_events_total", kind="rank_failure", mode="reconfigure") == 1
    assert value(v, "hyperpodrun_worker_failures_total") == 1
    assert "hyperpodrun_restarts_total" not in str(v)  # no worker group was restarted


def test_progress_sets_steps_and_rate_per_local_rank() -> None:
    metrics = AgentMetrics()
    metrics.observe_progress((5, 4, 4), (0.5, 0.25, 0.0))
    v = _values(metrics)
    assert [value(v, "hyperpodrun_rank_steps", local_rank=str(r)) for r in range(3)] == [5, 4, 4]
    assert [value(v, "hyperpodrun_rank_step_rate", local_rank=str(r)) for r in range(3)] == [2.0, 4.0, 0.0]
    metrics.observe_progress((6,), (0.5,))  # a smaller group: the other ranks' series go away
    v = _values(metrics)
    assert value(v, "hyperpodrun_rank_steps", local_rank="0") == 6
    assert value(v, "hyperpodrun_rank_steps", local_rank="1") is None


def test_instrumented_store_times_calls_and_counts_errors() -> None:
    ticks = iter([0.0, 0.002, 1.0, 1.5, 2.0, 2.0])
    metrics = AgentMetrics(clock=lambda: next(ticks))
    with EmbeddedStoreServer("127.0.0.1", 0, secret=new_secret(), publish_secret=True) as server:
        client = create_store("embedded", server.endpoint, run_id="metrics", conf={}, host=False, timeout=2.0)
        store = metrics.instrument_store(client)
        store.put("k", b"v")
        assert store.get("k").value == b"v"
        v = _values(metrics)
        assert value(v, "hyperpodrun_store_request_seconds_count", op="put") == 1
        assert value(v, "hyperpodrun_store_request_seconds_sum", op="put") == pytest.approx(0.002)
        assert value(v, "hyperpodrun_store_request_seconds_sum", op="get") == pytest.approx(0.5)
    with pytest.raises(StoreError):  # the server is gone
        store.get("k")
    store.close()
    assert value(_values(metrics), "hyperpodrun_store_errors_total", op="get") == 1


def test_trainer_records_are_read_from_the_file(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "first_step", "source": "trainer", "job": "j", "round": 0}) + "\n")
    seen: list[dict] = []
    follower = TrainerRecords(path, seen.append, job="j", interval=3600)  # polled by hand below
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"event": "workers_started", "job": "j"}) + "\n")  # the agent's own: via its sink
            f.write(json.dumps({"event": "first_step", "source": "trainer", "job": "other"}) + "\n")
            f.write(json.dumps({"event": "first_step", "source": "trainer", "job": "j", "round": 2}) + "\n")
            f.write('{"event": "checkpoint_saved", "source": "trai')  # half a line: not yet
        follower.poll()
        assert [(r["event"], r["round"]) for r in seen] == [("first_step", 2)]  # history before start is skipped
        with open(path, "a") as f:
            f.write('ner", "job": "j", "round": 2}\n')
        follower.poll()
        assert [r["event"] for r in seen] == ["first_step", "checkpoint_saved"]
    finally:
        follower.close()


def test_endpoint_serves_text_format_on_loopback(fed) -> None:
    metrics, log = fed
    log.emit("rendezvous_done", round=5, world_size=3, members=["a"])
    server = serve(metrics, port=0)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        v = scrape(server.url)
        assert value(v, "hyperpodrun_round") == 5 and value(v, "hyperpodrun_world_size") == 3
        with pytest.raises(MetricsError, match="--metrics-port"):
            serve(metrics, port=server.port)  # taken
    finally:
        server.close()


def _metric_names() -> set[str]:
    """Every metric the agent serves, as exposed (counters with _total)."""
    names = set()
    for family in AgentMetrics().registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_docs_list_every_metric_and_the_dashboard_queries_only_real_ones() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    table = (docs / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(hyperpodrun_[a-z_]+)` \|", table, flags=re.M))
    assert documented == _metric_names()
    dashboard = json.loads((docs / "grafana" / "hyperpodrun_dashboard.json").read_text())
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"hyperpodrun_[a-z_]+", target["expr"])
    }
    assert queried == _metric_names()  # every metric on a panel, no panel on a metric that does not exist
