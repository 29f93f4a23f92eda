"""Local timeouts run on monotonic clocks: a step of the wall clock (NTP, a VM resumed) never makes
a healthy rank hung. Failed on the code that stamped progress with ``time.time()``."""

from __future__ import annotations

import time

from elastic_events.control import ControlReader, ControlWriter
from hyperpodrun.hang import hung_ranks, progress_clock


def test_a_forward_step_of_the_wall_clock_does_not_make_a_rank_hung(tmp_path, monkeypatch) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    try:
        ControlReader(tmp_path / "ctl", 0).check()  # the rank steps once, now
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 70.0)  # NTP steps the clock 70 s forward
        (progress,) = writer.progress()
        assert progress.step == 1
        assert hung_ranks([progress], now=progress_clock(), limit=60.0) == ()
        assert hung_ranks([progress], now=progress_clock() + 61.0, limit=60.0) == (0,)  # real idleness still counts
    finally:
        writer.close()


def test_progress_stamps_are_on_the_hosts_monotonic_clock(tmp_path) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=1)
    try:
        before = time.monotonic()
        ControlReader(tmp_path / "ctl", 0).check()
        (progress,) = writer.progress()
        assert before <= progress.time <= time.monotonic()
    finally:
        writer.close()
