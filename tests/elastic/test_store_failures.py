"""What users see when the rendezvous store is unreachable or its host agent leaves."""

from __future__ import annotations

import time

from support.cluster import COUNTER
from support.launch import hyperpodrun_cmd, run
from support.ports import free_port


def test_unreachable_etcd_is_one_line_naming_the_endpoint(tmp_path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    proc = run(
        hyperpodrun_cmd(
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "j",
            "--rdzv-conf",
            "store_timeout=2",
            str(COUNTER),
            str(tmp_path),
        ),
        timeout=60,
    )
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0] and "unreachable" in lines[0], proc.stderr


def test_reusing_a_finished_job_id_is_refused(make_job, etcd_endpoint) -> None:
    # (an embedded store dies with its job, so only a lasting store such as etcd can see a reuse)
    job = make_job(backend="etcd", endpoint=etcd_endpoint, nnodes="1:1")
    job.start_node("a")
    job.wait_steps(2)
    assert job.finish() == {"a": 0}
    again = job.start_node("again")
    assert again.wait(timeout=60) != 0
    assert "already ran and succeeded; use a new --rdzv-id" in job.stderr("again")


def test_embedded_store_host_leaving_is_reported(make_job) -> None:
    job = make_job(nnodes="1:2", flags=("--scaling-timeout", "5"))
    job.start_node("host")
    job.start_node("b")
    job.wait_for_nodes(2)
    job.kill_node_hard("host")
    assert job.nodes["b"].wait(timeout=60) != 0
    last = job.stderr("b").strip().splitlines()[-1]
    assert "is gone" in last and "cannot outlive its host agent" in last and "--rdzv-backend etcd" in last
