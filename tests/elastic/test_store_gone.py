"""A store gone for good ends the job within its documented deadline, the ranks saving first.

etcd killed (SIGKILL) and never back: after ``outage_timeout`` without the store, cooperative ranks
save at a step of their own and exit, and the launcher ends with one line naming the lost store
instead of riding the outage out for ever.
"""

from __future__ import annotations

import json
import time

from support.etcd import EtcdServer

OUTAGE_S, STORE_S = 3.0, 1.0


def test_a_store_gone_for_good_ends_the_job_after_the_ranks_saved(make_job) -> None:
    with EtcdServer() as etcd:
        job = make_job(
            backend="etcd",
            endpoint=etcd.endpoint,
            nnodes="1:2",
            flags=("--rdzv-conf", f"lease_ttl=2,tick=0.1,outage_timeout={OUTAGE_S:g},store_timeout={STORE_S:g}"),
        )
        node = job.start_node("a")
        job.wait_steps(5)
        etcd.kill()
        gone = time.monotonic()
        code = node.wait(timeout=60)
        took = time.monotonic() - gone
    # outage_timeout + store_timeout per request on the way out + the ranks' save and exit (up to 8 s on a loaded
    # machine): far inside the documented bound, which adds the 30-s graceful shutdown timeout the save may use
    assert took < OUTAGE_S + 4 * STORE_S + 8.0, took
    assert code == 1
    last = job.stderr("a").strip().splitlines()[-1]
    assert last.startswith("hyperpodrun: error: lost the rendezvous store"), last
    saved = json.loads((job.run_dir / "state.json").read_text())["step"]
    assert saved == job.progress()[-1]["step"]  # the ranks saved the step they stopped at
    assert job.events("store_lost")
