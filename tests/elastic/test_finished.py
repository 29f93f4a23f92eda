"""A job whose training finished is never trained again: no joiner is admitted after it, and a rank that
crashes at exit after its training finished counts as success (it is not restarted)."""

from __future__ import annotations

from pathlib import Path

from support.cluster import wait_until
from support.jsonl import read_jsonl

SCRIPT = Path(__file__).resolve().parent / "scripts" / "finish_then_crash.py"
STEPS = 6


def test_a_joiner_after_the_end_of_training_is_not_admitted_and_a_crash_at_exit_is_success(tmp_path, make_job):
    """Both reproductions of issue 21 in one job: rank 0 finishes, a second launcher arrives, rank 0 then
    dies by SIGABRT at exit. Before: the join was decided, the finished rank restarted, the epoch trained again."""
    job = make_job(script=SCRIPT, script_args=(str(tmp_path), str(STEPS)))
    a = job.start_node("a")
    wait_until(lambda: (tmp_path / "finished").exists(), timeout=120, what="rank 0's training to finish")
    b = job.start_node("b")
    b_id = next(e["node"] for e in job.events("agent_started") if e["pid"] == b.pid)
    # the decider saw b as a standby and held: before the fix, b was admitted (a join) once its ranks parked
    wait_until(
        lambda: any(b_id in e.get("standbys", ()) for e in job.events("scale_held")),
        timeout=60,
        what="the decider to hold scale events with b waiting",
    )
    (tmp_path / "crash").touch()
    assert a.wait(timeout=60) == 0, job.stderr("a")
    assert b.wait(timeout=60) == 0, job.stderr("b")
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # trained once, at one size
    assert {s["world"] for s in steps} == {1} and len({s["pid"] for s in steps}) == 1
    assert not job.events("scale_decided"), job.events("scale_decided")
    assert [e["step"] for e in job.events("training_finished")] == [STEPS]
    assert "after its training finished; counted as success" in job.stderr("a")
    assert not job.events("worker_failed")
