"""The launcher's side of SIGTERM under cluster managers (hyperpodrun.sigterm, reaper, supervisor).

Slurm signals every process of a job step; a rank under hyperpodrun takes SIGTERM as a request to
leave (tests/elastic_events/test_termination.py). Here: the agent still stops such ranks at once, its
reaper outlives the signal (its death made a launcher that left gracefully exit 1: job FAILED), and
a launcher waiting in a rendezvous answers SIGTERM at once (one waited over 40 s under Slurm).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hyperpodrun.reaper import Reaper
from support.cluster import wait_until
from support.jsonl import read_jsonl
from support.launch import clean_env, hyperpodrun_cmd
from support.ports import free_port

LOADER = Path(__file__).resolve().parents[1] / "elastic_events" / "workers" / "sigterm_loader.py"


def _launcher(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        hyperpodrun_cmd(*args), env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _ignores_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_the_reaper_outlives_sigterm_and_closing_a_dead_one_does_not_raise() -> None:
    reaper = Reaper()
    pid = reaper._proc.pid
    wait_until(lambda: _ignores_sigterm(pid), timeout=30, what="the reaper ignoring SIGTERM")
    reaper._proc.send_signal(signal.SIGTERM)
    reaper.close()
    assert reaper._proc.returncode == 0  # it ended on the agent's "exit", not on the signal
    dead = Reaper()
    dead._proc.kill()
    dead._proc.wait(timeout=10)
    dead.close()  # before: BrokenPipeError, which made the CLI exit 1


def test_a_launcher_stops_ranks_that_take_sigterm_as_a_leave_request_at_once(tmp_path: Path) -> None:
    """Such a rank (and its data-loader worker, which blocks SIGTERM too) would otherwise outlive the
    agent's SIGTERM for the whole --shutdown-timeout."""
    launcher = _launcher(
        "--rdzv-backend=static",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--shutdown-timeout=120",
        str(LOADER),
        str(tmp_path),
    )
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), timeout=120, what="the rank and its loader worker")
        ready = json.loads((tmp_path / "ready").read_text())
        assert ready["installed"] is True
        tree = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.pid in ready["workers"]]
        assert tree, "the data-loader worker is not below the launcher"
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 30, "the agent waited its --shutdown-timeout for ranks SIGTERM cannot end"
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.timeout(120)
def test_a_launcher_waiting_for_nodes_leaves_at_once_on_sigterm(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    launcher = _launcher(
        "--nnodes=2:2",
        "--nproc-per-node=1",
        "--rdzv-backend=embedded",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--event-log={events}",
        str(LOADER),
        str(tmp_path),
    )
    try:
        wait_until(
            lambda: any(e["event"] == "agent_started" for e in read_jsonl(events)),
            timeout=60,
            what="the launcher to wait for a second node",
        )
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        assert "left the job gracefully" in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
