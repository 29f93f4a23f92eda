"""A store outage does not stop training: etcd restarted, or paused for longer than the lease ttl.

The job's own etcd (the session's would disturb other tests), real launchers and ranks. The
ranks keep training while the store is unreachable; an agent whose lease expired meanwhile
registers again as the same node; no rank is restarted and no step is lost or redone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from support.cluster import wait_until
from support.etcd import EtcdServer
from support.in_place import INPLACE, worlds


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.mark.parametrize("fault", ["restart", "pause_past_the_lease"])
def test_training_goes_on_through_a_store_outage(make_job, own_etcd: EtcdServer, fault: str) -> None:
    job = make_job(backend="etcd", endpoint=own_etcd.endpoint, nnodes="1:2")  # lease ttl 2 s
    job.start_node("a")
    before = job.wait_steps(20)
    if fault == "restart":
        own_etcd.restart()
    else:
        own_etcd.pause()
        time.sleep(5.0)  # the fault itself: 2.5 lease ttls without a store
        during = max(p["step"] for p in job.progress())
        own_etcd.resume()
        assert during > before + 10, "the ranks stopped training while the store was paused"
    resumed = max(p["step"] for p in job.progress())
    assert job.wait_steps(20) > resumed  # still training once the store is back
    assert job.finish() == {"a": 0}, job.stderr("a")
    assert len(job.events("workers_started")) == 1  # the ranks were never restarted
    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1))  # no step lost or redone
    if fault != "restart":
        assert job.events("node_rejoined"), job.stderr("a")  # its lease had expired: it registered again


def test_a_store_paused_past_the_lease_repairs_nothing_in_place(make_job, own_etcd: EtcdServer) -> None:
    """Two nodes in place: etcd frozen for 2.5 lease ttls lets both nodes' leases lapse while every rank
    trains on. The decider that watches the store again sees the other member's record gone before that
    agent has registered again; no failure explains it, so it is no lost node: no event, no rank started."""
    job = make_job(backend="etcd", endpoint=own_etcd.endpoint, nnodes="2", script=INPLACE)
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: job.events("round_in_process"), timeout=90, what="the round to run in-process")
    before = job.wait_steps(20)
    own_etcd.pause()
    time.sleep(5.0)  # the fault itself: 2.5 lease ttls without a store
    own_etcd.resume()
    wait_until(lambda: len(job.events("node_rejoined")) == 2, timeout=30, what="both agents to register again")
    resumed = job.wait_steps(40)
    assert job.finish() == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    assert [e["kind"] for e in job.events("scale_decided")] == [], job.events("scale_decided")
    records = worlds(job)
    assert [(r["world"], r["how"]) for r in records] == [(job.world(2), "fresh")] * job.world(2), records  # no repair
    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= resumed > before  # no step lost or redone
    assert {p["world"] for p in job.progress()} == {job.world(2)}
