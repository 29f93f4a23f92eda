"""An elastic job across two hosts, where no rank can take a loopback shortcut.

Two network namespaces joined by a veth pair stand in for two machines (support.netns); etcd
runs on host a, one launcher on each. Each host's name resolves to 127.0.1.1, as in many
containers and on Debian hosts, so gloo's default choice of address (its hostname's) is a
loopback one the other host cannot reach: the job only forms because the agent gives its ranks
GLOO_SOCKET_IFNAME for the interface that carries its address on the route to the store.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cluster import ElasticJob, wait_until
from support.etcd import EtcdServer
from support.jsonl import read_jsonl
from support.netns import Host, two_hosts

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_steps.py"


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as pair:
        yield pair


@pytest.fixture
def etcd(hosts: tuple[Host, Host]) -> Iterator[EtcdServer]:
    with EtcdServer(host=hosts[0]) as server:
        yield server


@pytest.fixture
def job(tmp_path: Path, etcd: EtcdServer) -> Iterator[ElasticJob]:
    # Torn down before etcd and the namespaces (fixture order): no launcher outlives its host.
    job = ElasticJob(
        tmp_path,
        backend="etcd",
        endpoint=etcd.endpoint,
        nnodes="1:2",
        script=SCRIPT,
        flags=("--scaling-timeout", "60"),  # start at once when both are there; never at 1 by chance
        nproc_per_node=1,  # one rank a host: ranks 0 and 1 are the replicas on the two hosts
    )
    yield job
    job.close()


def _progress(job: ElasticJob) -> list[dict]:
    return read_jsonl(job.run_dir / "progress.jsonl")


def _round_at(job: ElasticJob, world: int, *, after_round: int = 0) -> dict | None:
    """The first round after ``after_round`` that trained at ``world``; fails fast if a launcher died."""
    for name, proc in job.nodes.items():
        if proc.poll() is not None and not (name == "b" and world == 1):
            pytest.fail(f"launcher {name} exited {proc.returncode} early:\n{job.stderr(name)[-3000:]}")
    return next((p for p in _progress(job) if p["world"] == world and p["round"] > after_round), None)


@pytest.mark.slow
def test_job_forms_across_two_hosts_and_survives_a_graceful_leave(hosts, job: ElasticJob) -> None:
    a, b = hosts
    job.start_node("a", wrap=a.wrap)
    job.start_node("b", wrap=b.wrap)

    both = wait_until(lambda: _round_at(job, 2), timeout=90, what="a round training at world size 2")
    files = [job.run_dir / f"params-{both['round']}-{r}.json" for r in (0, 1)]
    wait_until(
        lambda: all(f.exists() for f in files), timeout=30, what="both ranks' parameters (rank 0 logs progress first)"
    )
    replicas = [json.loads(f.read_text()) for f in files]
    assert [r["world"] for r in replicas] == [2, 2]
    assert replicas[0]["step"] == replicas[1]["step"]
    assert replicas[0]["params"] == replicas[1]["params"], "DDP replicas diverged across the two hosts"
    for name, host in (("a", a), ("b", b)):
        assert f"GLOO_SOCKET_IFNAME={host.netns}v" in job.stderr(name)

    job.signal("b", signal.SIGTERM)
    alone = wait_until(
        lambda: _round_at(job, 1, after_round=both["round"]), timeout=90, what="the survivor training at world size 1"
    )
    assert alone["step"] > both["step"], "the survivor did not resume from the state saved at world size 2"
    assert job.nodes["b"].wait(timeout=60) == 0, job.stderr("b")
    assert "left the job gracefully" in job.stderr("b")
    (job.run_dir / "stop").touch()
    assert job.nodes["a"].wait(timeout=60) == 0, job.stderr("a")
