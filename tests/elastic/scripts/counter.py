"""A stand-in trainer for elastic tests: one all-reduce per step, the step persisted at every event.

argv: RUN_DIR. The state (global step) lives in RUN_DIR/state.json, written by rank 0 when
elastic_event_detected() says so and at the end. Every step rank 0 appends {"step", "world"}
to RUN_DIR/progress.jsonl. The job ends at the first step after RUN_DIR/stop exists
(agreed through the same all-reduce), so tests decide when training is over. A step pauses STEP_PAUSE_S after
its all-reduce, so a rank leaves most of its core to the launchers and processes that start beside it.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_events import elastic_event_detected, restart_reason

STEP_PAUSE_S = 0.005
run = Path(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
state = run / "state.json"
step = json.loads(state.read_text())["step"] if state.exists() else 0
print(f"rank {rank}/{world} resumes at step {step} ({restart_reason()})", flush=True)


def save(step: int) -> None:
    if rank == 0:
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step}))
        tmp.replace(state)
    dist.barrier()


while True:
    # The step "trains": an all-reduce that also agrees on stopping, and proves ranks are in lockstep.
    t = torch.tensor([float(step), float((run / "stop").exists())])
    dist.all_reduce(t)
    if t[0].item() != step * world:
        raise RuntimeError(f"ranks out of lockstep at step {step}: sum {t[0].item()} != {step * world}")
    step += 1
    time.sleep(STEP_PAUSE_S)
    if rank == 0:
        with open(run / "progress.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": world, "ts": time.time()}) + "\n")
    if elastic_event_detected():
        save(step)
        print(f"rank {rank} saved at step {step} for a scale event", flush=True)
        break
    if t[1].item() > 0:
        save(step)
        print(f"rank {rank} finished at step {step}", flush=True)
        break
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip interpreter finalization: torch's gloo teardown can abort there (SIGABRT, pytorch/pytorch#179291)
