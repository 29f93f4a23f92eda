"""Hang detection: a rank without progress is found, its stacks are dumped, and it counts as a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from elastic_events.control import RankPhase, RankProgress
from hyperpodrun.hang import HangPolicy, hung_ranks
from support.cluster import COUNTER, wait_until
from support.launch import clean_env, hyperpodrun_cmd

NOW = 10_000.0


def progress(step: int, last: float, phase: RankPhase = RankPhase.RUNNING) -> RankProgress:
    return RankProgress(step=step, time=NOW - last, acked_event=0, phase=phase)


def test_a_rank_is_hung_after_the_limit_without_a_step_and_only_while_stepping() -> None:
    ranks = [progress(40, 1.0), progress(40, 61.0), progress(0, 500.0), progress(40, 500.0, RankPhase.PARKED)]
    assert hung_ranks(ranks, now=NOW, limit=60.0) == (1,)  # not started yet, or parked: not hung
    assert hung_ranks(ranks, now=NOW, limit=None) == ()


@pytest.mark.parametrize(
    ("timeout", "slowest", "limit"),
    [(None, 0.2, 60.0), (None, 30.0, 300.0), (5.0, 30.0, 5.0), (0.0, 30.0, None)],
)
def test_the_limit_is_ten_slowest_steps_at_least_a_minute_unless_set(timeout, slowest, limit) -> None:
    assert HangPolicy(timeout=timeout).limit(slowest) == limit


def test_a_stopped_rank_is_reported_with_its_stacks_and_fails_the_job(tmp_path) -> None:
    """SIGSTOP of one rank: both ranks stop stepping (the other waits in its all-reduce)."""
    events = tmp_path / "events.jsonl"
    cmd = hyperpodrun_cmd(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--hang-timeout",
        "2",
        "--monitor-interval",
        "0.05",
        "--event-log",
        str(events),
        "--log-dir",
        str(tmp_path / "logs"),
        str(COUNTER),
        str(tmp_path),
    )
    launcher = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            lambda: (
                (tmp_path / "progress.jsonl").exists()
                and len((tmp_path / "progress.jsonl").read_text().splitlines()) > 20
            ),
            timeout=60,
            what="a few steps",
        )
        started = [json.loads(x) for x in events.read_text().splitlines() if '"workers_started"' in x]
        victim = started[-1]["pids"]["1"]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        code = launcher.wait(timeout=60)
        detected_after = time.monotonic() - stopped_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    err = launcher.stderr.read()
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("hyperpodrun: error: rank ") and "made no progress" in last and "hang timeout 2s" in last, (
        err
    )
    hung = [json.loads(x) for x in events.read_text().splitlines() if '"rank_hung"' in x]
    assert len(hung) == 1 and hung[0]["idle_s"] >= 2
    assert detected_after < 2 + 1 + 1 + 5  # the limit, the monitor and store ticks, the dump grace, a stop
    logs = [p.read_text() for p in (tmp_path / "logs").rglob("stderr.log")]
    assert sum("most recent call first" in text for text in logs) == 2, logs  # every local rank's stacks
