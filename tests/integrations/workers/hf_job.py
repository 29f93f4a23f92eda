"""A tiny Hugging Face Trainer job for the elastic tests.

argv: RUN_DIR MAX_STEPS [MODE]. Trains a linear regression on 48 local samples with a
global batch of 8 (per-device batch 2, accumulation planned for the world size).
MODE ``restart`` (default) is the restart-path structure: a plain ``Trainer`` and the
callback. ``in_place`` adds ``elastic_init()`` and uses ``ElasticTrainer``: scale events
keep the ranks that stay.
Writes RUN_DIR/samples-<rank>.jsonl ({"step", "world", "ids"} per optimizer step)
and RUN_DIR/loss.jsonl ({"step", "world", "loss"} from rank 0). Under hyperpodrun
the first round holds at step 8 (HOLD_AT) until the launcher has announced a scale event
(RUN_DIR/held-<rank> says it is holding), so tests need no timing.
"""

import json
import sys
from pathlib import Path

import torch
from job_common import GLOBAL_BATCH, MICRO_BATCH, Samples, end_of_training, hold_for_event, log_step
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from elastic_events.integrations.transformers import (
    ElasticCallback,
    ElasticTrainer,
    elastic_init,
    elastic_resume_checkpoint,
    set_global_batch,
)

run, max_steps = Path(sys.argv[1]), int(sys.argv[2])
in_place = (sys.argv[3] if len(sys.argv) > 3 else "restart") == "in_place"


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, x, labels, idx):
        self.seen += idx.tolist()
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class Record(TrainerCallback):
    """Sample ids per optimizer step; the loss the Trainer logs (the mean over the global batch)."""

    def __init__(self, model: Regressor) -> None:
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        log_step(
            run, rank=args.process_index, world=args.world_size, step=state.global_step, ids=self.model.seen, loss=None
        )
        self.model.seen = []
        hold_for_event(run, rank=args.process_index, step=state.global_step, world=args.world_size)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(run / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "world": args.world_size, "loss": logs["loss"]}) + "\n")


if in_place:
    elastic_init()  # a pre-warmed joiner waits here for its admission
args = TrainingArguments(
    output_dir=str(run / "out"),
    per_device_train_batch_size=MICRO_BATCH,
    max_steps=max_steps,
    learning_rate=0.05,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
    dataloader_num_workers=0,
    remove_unused_columns=False,
)
set_global_batch(args, GLOBAL_BATCH)
set_seed(args.seed)  # the initial weights, the same in every run
model = Regressor()
trainer = (ElasticTrainer if in_place else Trainer)(
    model=model,
    args=args,
    train_dataset=Samples(),
    callbacks=[ElasticCallback(global_batch=GLOBAL_BATCH), Record(model)],
)
trainer.train(resume_from_checkpoint=elastic_resume_checkpoint(args.output_dir))
end_of_training(run)
