"""Worker for test_checkpoint.py: ranks whose checkpoint directories are not shared.

Each rank uses ``BASE/node<rank>`` as "the" checkpoint directory, as if every node
had mounted a local disk at the same path. ``BASE/node0`` holds a checkpoint made
beforehand, so rank 0 sees it and the other ranks do not. Every rank records the
error type and message of a load and of a save to ``BASE/result_rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_events.checkpoint import CheckpointConfig, Checkpointer, CheckpointError


def attempt(action) -> dict[str, str]:
    try:
        action()
    except CheckpointError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


def main() -> None:
    base = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(CheckpointConfig(dir=base / f"node{rank}", timeout_s=60))
    result = {
        "load": attempt(lambda: ckpt.load(model=model)),
        "save": attempt(lambda: ckpt.save(7, model=model)),
    }
    (base / f"result_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
