"""A launcher that arrives after the job's training finished, and what the job must show for it (tests only).

The job's script trains on one node, writes RUN_DIR/finished when its training is over, waits for
RUN_DIR/crash and then aborts (as torch's gloo teardown did at interpreter exit).
"""

from __future__ import annotations

from pathlib import Path

from support.cluster import ElasticJob, wait_until


def join_after_the_end(job: ElasticJob, run: Path, *, finish_timeout: float = 120) -> None:
    """Node a trains to the end; node b arrives and is held as a standby; a's rank then aborts. Both
    launchers must exit 0."""
    a = job.start_node("a")
    wait_until(lambda: (run / "finished").exists(), timeout=finish_timeout, what="rank 0's training to finish")
    b = job.start_node("b")
    b_id = next(e["node"] for e in job.events("agent_started") if e["pid"] == b.pid)
    # the decider sees b as a standby and holds: a join would restart the finished rank and train again
    wait_until(
        lambda: any(b_id in e.get("standbys", ()) for e in job.events("scale_held")),
        timeout=60,
        what="the decider to hold scale events with b waiting",
    )
    (run / "crash").touch()
    assert a.wait(timeout=60) == 0, job.stderr("a")[-3000:]
    assert b.wait(timeout=60) == 0, job.stderr("b")[-3000:]


def assert_finished_once(job: ElasticJob, *, steps: int) -> None:
    """No event was decided, the training said it finished at ``steps``, and the abort after it was success."""
    assert not job.events("scale_decided"), job.events("scale_decided")
    assert [e["step"] for e in job.events("training_finished")] == [steps]
    assert "after its training finished; counted as success" in job.stderr("a")
    assert not job.events("worker_failed")
