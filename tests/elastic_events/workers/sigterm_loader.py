"""A rank with a data-loader worker, under a control channel: how it takes SIGTERM (test_termination.py).

argv[1]: a folder. Writes ``ready`` (JSON: whether SIGTERM became a leave request, the worker's pid),
keeps taking batches until ``go`` appears (a worker that died makes the loader raise), takes five more
and exits 0. A script with its own handler sets it first when argv[2] is ``own-handler``.
"""

import json
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import elastic_events


class Numbers(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


out = Path(sys.argv[1])
if sys.argv[2:] == ["own-handler"]:
    signal.signal(signal.SIGTERM, lambda *_: (out / "own_handler_ran").write_text("1"))
installed = elastic_events.leave_on_sigterm()
batches = iter(DataLoader(Numbers(), batch_size=2, num_workers=1))
next(batches)
ready = {"installed": installed, "workers": [w.pid for w in batches._workers]}
(out / "ready.tmp").write_text(json.dumps(ready))
(out / "ready.tmp").rename(out / "ready")
deadline = time.monotonic() + 120
while not (out / "go").exists():
    next(batches)
    time.sleep(0.01)
    if time.monotonic() > deadline:
        sys.exit(3)
for _ in range(5):
    next(batches)
