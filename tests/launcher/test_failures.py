"""Failures: exit status, root-cause line, restarts, attempt folders, no process left behind."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run

FAIL = str(SCRIPTS / "fail.py")


@pytest.mark.parametrize(
    ("mode", "expected", "start_method"),
    [
        ("exit:3", "rank 1 (local rank 1, pid {pid}) exited with code 3", "spawn"),
        ("signal:SIGKILL", "rank 1 (local rank 1, pid {pid}) was killed by SIGKILL", "spawn"),
        ("raise:boom-from-rank-1", "exited with code 1: ValueError: boom-from-rank-1", "spawn"),
        # ranks forked from the node's fork server: the same statuses, the same root cause from the error file
        ("signal:SIGKILL", "rank 1 (local rank 1, pid {pid}) was killed by SIGKILL", "forkserver"),
        ("raise:boom-from-rank-1", "exited with code 1: ValueError: boom-from-rank-1", "forkserver"),
    ],
)
def test_failure_exit_status_and_root_cause(tmp_path: Path, mode: str, expected: str, start_method: str) -> None:
    start = time.monotonic()
    proc = run(
        hyperpodrun_cmd(
            "--nproc-per-node",
            "2",
            "--start-method",
            start_method,
            "--log-dir",
            str(tmp_path),
            "--rdzv-id",
            "j",
            FAIL,
            mode,
        ),
        timeout=90,
    )
    assert time.monotonic() - start < 60, "the healthy sibling was waited for instead of stopped"
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hyperpodrun: error: rank 1 "), proc.stderr
    assert expected.split(" (")[0] in last and expected.split("{pid}) ")[-1] in last
    log_file = tmp_path / "j" / "attempt_0" / "1" / "stderr.log"
    assert f"log: {log_file}" in last
    assert log_file.exists()


def test_max_restarts_counts_up_and_recovers(tmp_path: Path) -> None:
    proc = run(
        hyperpodrun_cmd(
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--log-dir",
            str(tmp_path),
            "--rdzv-id",
            "r",
            FAIL,
            "exit:5",
            "first-attempt-only",
        ),
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 attempt 1 reason failure" in proc.stdout
    assert "restarting the workers (1/2)" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "r").glob("attempt_*")) == ["attempt_0", "attempt_1"]
    # the failed attempt's logs are kept
    assert "attempt 0" in (tmp_path / "r" / "attempt_0" / "1" / "stdout.log").read_text()


def test_restarts_used_up_and_attempt_folders_kept_across_launches(tmp_path: Path) -> None:
    args = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        str(tmp_path),
        "--rdzv-id",
        "r",
        FAIL,
        "exit:7",
    ]
    proc = run(hyperpodrun_cmd(*args), timeout=120)
    assert proc.returncode == 1
    assert "exited with code 7" in proc.stderr and "(after 1 restart)" in proc.stderr
    run(hyperpodrun_cmd(*args), timeout=120)  # same run id again: earlier attempts must survive
    assert sorted(p.name for p in (tmp_path / "r").glob("attempt_*")) == [f"attempt_{i}" for i in range(4)]


def _wait_for_files(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not write {paths} within {timeout}s")
        time.sleep(0.05)


def _tree_pids(tmp_path: Path) -> list[int]:
    pids = []
    for f in tmp_path.glob("pids_*"):
        pids += [int(x) for x in f.read_text().split()]
    return pids


@pytest.mark.parametrize(
    ("sig", "start_method"),
    [
        (signal.SIGTERM, "spawn"),
        (signal.SIGINT, "spawn"),
        (signal.SIGKILL, "spawn"),
        (signal.SIGTERM, "forkserver"),
        (signal.SIGKILL, "forkserver"),  # the forked ranks' PR_SET_PDEATHSIG points at the launcher, not the server
    ],
)
def test_signal_to_launcher_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals, start_method: str) -> None:
    launcher = subprocess.Popen(
        hyperpodrun_cmd(
            "--nproc-per-node",
            "2",
            "--start-method",
            start_method,
            "--shutdown-timeout",
            "5",
            str(SCRIPTS / "tree.py"),
            str(tmp_path),
        ),
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_files([tmp_path / "pids_0", tmp_path / "pids_1"], timeout=60)
        pids = _tree_pids(tmp_path)
        assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids)
        pids += [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]  # its reaper, a fork server
        launcher.send_signal(sig)
        code = launcher.wait(timeout=60)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"left behind after {sig.name}: {alive}"
        assert code == (128 + sig if sig != signal.SIGKILL else -signal.SIGKILL)
        if sig != signal.SIGKILL:
            assert f"received {sig.name}" in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
