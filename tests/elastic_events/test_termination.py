"""SIGTERM in a rank under hyperpodrun (elastic_events.termination): a leave request, and its workers live on.

Slurm sends SIGTERM to every process of a job step at once. Before the guard, the rank died of it (a
rank failure to the launcher) and so did its data-loader workers; ignoring it in the rank was not
enough, since PyTorch's workers install their own handler. Each test signals the rank's whole process
group, as slurmstepd does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_events.control import CAP_LEAVE_ON_SIGTERM, ControlWriter
from support.cluster import wait_until
from support.launch import clean_env

WORKER = Path(__file__).parent / "workers" / "sigterm_loader.py"


def _start(tmp_path: Path, *args: str, channel: bool = True) -> tuple[subprocess.Popen, dict]:
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if channel:
        env["HYPERPODRUN_CONTROL_FILE"] = str(tmp_path / "control.bin")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: signalled as a whole, like a Slurm job step
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc)
            pytest.fail(f"the rank did not get ready (exit {proc.poll()}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads((tmp_path / "ready").read_text())


def _end(proc: subprocess.Popen) -> None:
    """Whatever happened, nothing of the rank's process group outlives the test."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_sigterm_to_the_whole_step_is_a_leave_request_and_the_loader_worker_lives_on(tmp_path: Path) -> None:
    writer = ControlWriter(tmp_path / "control.bin", 1)
    proc, ready = _start(tmp_path)
    try:
        assert ready["installed"] is True
        assert writer.progress()[0].capabilities & CAP_LEAVE_ON_SIGTERM
        assert writer.termination_requests() == ()
        os.killpg(proc.pid, signal.SIGTERM)  # the rank and its worker, as slurmstepd does
        wait_until(lambda: writer.termination_requests() == (0,), timeout=30, what="the rank's leave request")
        assert proc.poll() is None, "the rank died of SIGTERM"
        assert all(psutil.pid_exists(pid) for pid in ready["workers"]), "the data-loader worker died of SIGTERM"
        (tmp_path / "go").write_text("")
        assert proc.wait(timeout=60) == 0  # the loader still delivered batches after the signal
        assert proc.stderr.read().count("rank 0: SIGTERM: the launcher leaves the job at the next agreed step") == 1
    finally:
        _end(proc)
        writer.close()


def test_a_script_that_handles_sigterm_itself_keeps_its_handler(tmp_path: Path) -> None:
    writer = ControlWriter(tmp_path / "control.bin", 1)
    proc, ready = _start(tmp_path, "own-handler")
    try:
        assert ready["installed"] is False
        os.kill(proc.pid, signal.SIGTERM)
        wait_until(lambda: (tmp_path / "own_handler_ran").exists(), timeout=30, what="the script's own handler")
        assert writer.termination_requests() == ()
        (tmp_path / "go").write_text("")
        proc.wait(timeout=60)
    finally:
        _end(proc)
        writer.close()


def test_outside_hyperpodrun_sigterm_ends_the_process_as_always(tmp_path: Path) -> None:
    proc, ready = _start(tmp_path, channel=False)
    try:
        assert ready["installed"] is False
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        _end(proc)
