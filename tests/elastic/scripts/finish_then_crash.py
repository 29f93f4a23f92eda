"""A trainer that finishes and then crashes at exit, as a framework's rank did at interpreter shutdown.

argv: RUN_DIR STEPS. A linear model on the in-process API trains STEPS steps through
``ElasticTraining.steps(until=STEPS)`` (which says the training finished), appends each step to
RUN_DIR/steps.jsonl, writes RUN_DIR/finished, waits until RUN_DIR/crash exists, then aborts (SIGABRT).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_events import ElasticSampler, ElasticTraining

run, steps = Path(sys.argv[1]), int(sys.argv[2])
x = torch.randn(8 * steps, 4, generator=torch.Generator().manual_seed(0))
dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
sampler = ElasticSampler(len(dataset), global_batch=8, micro_batch=8)
elastic = ElasticTraining(
    model_fn=lambda: torch.nn.Linear(4, 1),
    optimizer_fn=lambda model: torch.optim.SGD(model.parameters(), lr=0.01),
    sampler=sampler,
).start()
for step in elastic.steps(DataLoader(dataset, batch_sampler=sampler), until=steps):
    with step:
        (xb, yb), *_ = step.batch.micro_batches
        torch.nn.functional.mse_loss(elastic.model(xb), yb).backward()
        elastic.optimizer.step()
        elastic.optimizer.zero_grad()
    with open(run / "steps.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "step": step.number, "world": elastic.world_size}) + "\n")
(run / "finished").touch()
deadline = time.monotonic() + 60
while not (run / "crash").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
os.abort()
