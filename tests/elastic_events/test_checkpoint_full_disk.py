"""Saves recover from a full disk, and pruning never removes another writer's save in progress.

Failed on the code that left every failed save's ``.tmp-*`` folder until the next successful
save (on a 2.6 MB tmpfs, 5 saves in a row failed after space was freed), and whose pruning
removed every ``.tmp-*`` folder, another writer's save in progress included.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from elastic_events.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, list_checkpoints
from elastic_events.checkpoint.layout import prune


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)  # 257 KiB of parameters


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1.5 MiB tmpfs: room for one checkpoint of the model and a ballast, not two (CI runs as root)."""
    point = tmp_path / "disk"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(point)], check=True, capture_output=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def test_saves_work_again_once_a_full_disk_has_room(small_disk: Path) -> None:
    model, root = _model(), small_disk / "ckpt"
    ckpt = Checkpointer(CheckpointConfig(dir=root, keep_last=1))
    ballast = small_disk / "ballast"
    with open(ballast, "wb") as f:  # fill the disk to 200 KiB short of full
        f.write(b"\0" * (1536 - 200) * 1024)
    for step in (1, 2, 3):
        with pytest.raises(CheckpointError, match="is full"):
            ckpt.save(step, model=model)
        assert not list(root.glob("*.tmp-*"))  # each failed save gave its space back
    ballast.unlink()  # the operator frees space: the very next save succeeds
    ckpt.save(4, model=model)
    assert [info.step for info in list_checkpoints(root)] == [4]


def _partial(root: Path, name: str, writer: dict | None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard in progress")
    if writer is not None:
        (path / "WRITER").write_text(json.dumps(writer))
    return path


def test_pruning_leaves_saves_in_progress_and_removes_those_of_dead_writers(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    host = socket.gethostname()
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        live = _partial(
            root,
            "step_000000007.tmp-0000aaaa",
            {"host": host, "pid": other.pid, "started": psutil.Process(other.pid).create_time()},
        )
        elsewhere = _partial(root, "step_000000007.tmp-0000bbbb", {"host": "node-b", "pid": 1, "started": 0.0})
        unknown = _partial(root, "step_000000007.tmp-0000cccc", None)
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        crashed = _partial(root, "step_000000006.tmp-0000dddd", {"host": host, "pid": int(dead.stdout), "started": 0.0})
        reused = _partial(  # the pid runs again, but it is another process (its start time differs)
            root, "step_000000005.tmp-0000eeee", {"host": host, "pid": other.pid, "started": 1.0}
        )
        ckpt = Checkpointer(CheckpointConfig(dir=root, keep_last=1))
        ckpt.save(8, model=_model())
        prune(root, keep_last=1, saved=root / "step_000000008")
        assert live.is_dir() and elsewhere.is_dir() and unknown.is_dir()  # another writer's save in progress
        assert not crashed.exists() and not reused.exists()
        assert [info.step for info in list_checkpoints(root)] == [8]
    finally:
        other.stdin.close()
        other.wait(timeout=10)
