"""Ctrl-C and SIGTERM end a launcher that waits in the rendezvous within a second, and the
wait says what it waits for at the default log level. Failed on the code that only noted the
signal (25 s and SIGKILL, up to the join timeout) and logged the waiting line at INFO."""

from __future__ import annotations

import select
import signal
import subprocess
import time

import pytest

from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd
from support.ports import free_port


def _line(proc: subprocess.Popen, *, timeout: float) -> str:
    """The launcher's next stderr line, or a failure naming what did not come."""
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    assert ready, f"no line on stderr within {timeout:g}s"
    return proc.stderr.readline()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_ends_a_launcher_waiting_for_other_nodes_within_a_second(sig: signal.Signals, tmp_path) -> None:
    cmd = hyperpodrun_cmd(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--log-dir",
        str(tmp_path),
        str(SCRIPTS / "echo_args.py"),
    )
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=clean_env())
    try:
        waiting = _line(proc, timeout=30)
        assert waiting.startswith("hyperpodrun: waiting for a round (") and "1 more needed" in waiting, waiting
        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=10)
        took = time.monotonic() - sent
        rest = proc.stderr.read().strip().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took <= 1.0, f"{took:.2f}s"
    if sig == signal.SIGTERM:  # an elastic job's SIGTERM is a graceful leave (Slurm: COMPLETED), as for a running node
        assert code == 0
        assert rest == ["hyperpodrun: SIGTERM: leaving the job", "hyperpodrun: left the job gracefully"], rest
    else:
        assert code == 128 + sig
        assert rest == [f"hyperpodrun: error: received {sig.name}; workers stopped"], rest
