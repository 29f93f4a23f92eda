"""Run the launchers under test as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "launcher" / "scripts"


def clean_env(**extra: str) -> dict[str, str]:
    """The parent environment without launcher variables that would leak into the child."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "HYPERPODRUN_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def hyperpodrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hyperpodrun", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run(cmd: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)
