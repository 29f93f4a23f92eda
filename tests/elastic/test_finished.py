"""A job whose training finished is never trained again: no joiner is admitted after it, and a rank that
crashes at exit after its training finished counts as success (it is not restarted)."""

from __future__ import annotations

from pathlib import Path

from support.finished import assert_finished_once, join_after_the_end
from support.jsonl import read_jsonl

SCRIPT = Path(__file__).resolve().parent / "scripts" / "finish_then_crash.py"
STEPS = 6


def test_a_joiner_after_the_end_of_training_is_not_admitted_and_a_crash_at_exit_is_success(tmp_path, make_job):
    """Both reproductions of issue 21 in one job: rank 0 finishes, a second launcher arrives, rank 0 then
    dies by SIGABRT at exit. Before: the join was decided, the finished rank restarted, the epoch trained again."""
    job = make_job(script=SCRIPT, script_args=(str(tmp_path), str(STEPS)))
    join_after_the_end(job, tmp_path)
    steps = read_jsonl(tmp_path / "steps.jsonl")  # every rank's
    pids = {s["pid"] for s in steps}
    assert len(pids) == job.world(1) and {s["world"] for s in steps} == {job.world(1)}, steps  # one size, no restart
    for pid in pids:  # trained once
        assert [s["step"] for s in steps if s["pid"] == pid] == list(range(1, STEPS + 1)), steps
    assert_finished_once(job, steps=STEPS)
