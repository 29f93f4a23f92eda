"""The agent run inside another program's process (as PyTorch's launcher tests run torchrun's
``main``) leaves that program's children and settings alone. Failed on the code whose
``waitpid(-1)`` reaped any child of the process, and which left it a child subreaper."""

from __future__ import annotations

import ctypes
import subprocess

from hyperpodrun import cli
from support.launch import SCRIPTS

_PR_GET_CHILD_SUBREAPER = 37


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


def test_the_agent_reaps_only_its_own_children_and_restores_the_subreaper_flag(monkeypatch, tmp_path) -> None:
    for name in ("PET_NPROC_PER_NODE", "PET_NNODES", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        monkeypatch.delenv(name, raising=False)
    was_subreaper = _is_subreaper()
    # The embedding program's own child, which exits while the agent runs.
    mine = subprocess.Popen(["sh", "-c", "exit 7"])
    code = cli.main(["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "echo_args.py")])
    assert code == 0
    assert mine.wait(timeout=10) == 7  # not reaped by the agent (Popen would report 0 for a lost status)
    assert _is_subreaper() == was_subreaper
