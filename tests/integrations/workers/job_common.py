"""What the tests' Trainer and Lightning jobs share: the data, the logs, the hold for a scale event."""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from elastic_events import current_event, is_elastic, restart_reason

GLOBAL_BATCH, MICRO_BATCH, HOLD_AT, HOLD_TIMEOUT = 8, 2, 8, 120.0  # HOLD_AT: in epoch 1 (6 steps per epoch)
SHRINK_HOLD_AT = 80  # past the target step of a join announced at HOLD_AT, mid-epoch (epoch 13)


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


def hold_for_event(run: Path, *, rank: int, step: int, world: int) -> None:
    """In the first round under hyperpodrun, wait at step HOLD_AT until the launcher announced an event.

    The test adds or removes a node meanwhile; the launcher then picks a target step. No timing involved.
    With RUN_DIR/shrink-later, wait again at step SHRINK_HOLD_AT (the job has grown by then) until an event
    to a smaller world was announced: the test removes a node meanwhile.
    """
    if not is_elastic():
        return
    if restart_reason() == "start" and step == HOLD_AT:
        _hold(run / f"held-{rank}", lambda: current_event() is not None, f"a scale event at step {step}")
    elif step == SHRINK_HOLD_AT and (run / "shrink-later").exists():
        _hold(run / f"shrink-held-{rank}", lambda: _smaller(world), f"an event to fewer than {world} ranks")


def _smaller(world: int) -> bool:
    event = current_event()
    return event is not None and event.world_size < world


def _hold(marker: Path, announced: Callable[[], bool], what: str) -> None:
    marker.touch()
    deadline = time.monotonic() + HOLD_TIMEOUT
    while not announced():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{marker.name}: no announcement of {what} within {HOLD_TIMEOUT:g}s")
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
