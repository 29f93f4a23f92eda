"""What the tests' Trainer and Lightning jobs share: the data, the logs, the hold for a scale event."""

import json
import os
import time
from pathlib import Path

import torch

from elastic_events import current_event, is_elastic, restart_reason

GLOBAL_BATCH, MICRO_BATCH, HOLD_AT, HOLD_TIMEOUT = 8, 2, 8, 120.0  # HOLD_AT: in epoch 1 (6 steps per epoch)


class Samples(torch.utils.data.Dataset):
    """48 noisy samples of a linear function, each with its index (the sample id the tests compare)."""

    def __init__(self, n: int = 48, target: str = "labels") -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)
        self.target = target

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], self.target: self.y[i], "idx": i}


def log_step(run: Path, *, rank: int, world: int, step: int, ids: list[int], loss: float | None) -> None:
    """Append this rank's sample ids of ``step`` and its process id (and, from rank 0, the step's loss)."""
    with open(run / f"samples-{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "world": world, "ids": sorted(ids), "pid": os.getpid()}) + "\n")
    if loss is not None:
        with open(run / "loss.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": world, "loss": loss}) + "\n")


def hold_for_event(run: Path, *, rank: int, step: int) -> None:
    """In the first round under hyperpodrun, wait at step HOLD_AT until the launcher announced an event.

    The test adds or removes a node meanwhile; the launcher then picks a target step. No timing involved.
    """
    if not (is_elastic() and restart_reason() == "start" and step == HOLD_AT):
        return
    (run / f"held-{rank}").touch()
    deadline = time.monotonic() + HOLD_TIMEOUT
    while current_event() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no scale event announced within {HOLD_TIMEOUT:g}s of holding at step {HOLD_AT}")
        time.sleep(0.02)


def end_of_training(run: Path) -> None:
    """Exit 0 without the interpreter's teardown; with RUN_DIR/linger, first say the training is over
    (RUN_DIR/finished), wait for RUN_DIR/crash, and abort (SIGABRT), as torch's gloo teardown did at exit."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if (run / "linger").exists():
        (run / "finished").touch()
        deadline = time.monotonic() + HOLD_TIMEOUT
        while not (run / "crash").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.abort()
    os._exit(0)  # skip interpreter finalization: torch's gloo teardown can abort there (pytorch/pytorch#179291)
