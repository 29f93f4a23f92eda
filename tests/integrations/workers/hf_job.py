"""A tiny Hugging Face Trainer job for the elastic tests.

argv: RUN_DIR MAX_STEPS. Trains a linear regression on 48 local samples with a
global batch of 8 (per-device batch 2, accumulation planned for the world size).
Writes RUN_DIR/samples-<rank>.jsonl ({"step", "world", "ids"} per optimizer step)
and RUN_DIR/loss.jsonl ({"step", "world", "loss"} from rank 0). Under hyperpodrun
the first round holds at step 3 until the launcher has announced a scale event
(RUN_DIR/held-<rank> says it is holding), so tests need no timing.
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from elastic_events import current_event, is_elastic, restart_reason
from elastic_events.integrations.transformers import ElasticCallback, elastic_resume_checkpoint, set_global_batch

GLOBAL_BATCH, HOLD_AT, HOLD_TIMEOUT = 8, 3, 120.0
run, max_steps = Path(sys.argv[1]), int(sys.argv[2])


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "idx": i}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, x, labels, idx):
        self.seen += idx.tolist()
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class Record(TrainerCallback):
    """Sample ids and loss per optimizer step; the hold that lets a test make its scale event."""

    def __init__(self, model: Regressor) -> None:
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        with open(run / f"samples-{args.process_index}.jsonl", "a") as f:
            f.write(json.dumps({"step": state.global_step, "world": args.world_size, "ids": sorted(self.model.seen)}) + "\n")
        self.model.seen = []
        if is_elastic() and restart_reason() == "start" and state.global_step == HOLD_AT:
            (run / f"held-{args.process_index}").touch()
            deadline = time.monotonic() + HOLD_TIMEOUT
            while current_event() is None:  # the test adds or removes a node; the launcher picks a target step
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no scale event announced within {HOLD_TIMEOUT:g}s of holding at step {HOLD_AT}")
                time.sleep(0.02)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(run / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "world": args.world_size, "loss": logs["loss"]}) + "\n")


args = TrainingArguments(
    output_dir=str(run / "out"), per_device_train_batch_size=2, max_steps=max_steps, learning_rate=0.05,
    logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
    dataloader_num_workers=0, remove_unused_columns=False,
)  # fmt: skip
set_global_batch(args, GLOBAL_BATCH)
set_seed(args.seed)  # the initial weights, the same in every run
model = Regressor()
trainer = Trainer(
    model=model, args=args, train_dataset=Samples(),
    callbacks=[ElasticCallback(global_batch=GLOBAL_BATCH), Record(model)],
)  # fmt: skip
trainer.train(resume_from_checkpoint=elastic_resume_checkpoint(args.output_dir))
