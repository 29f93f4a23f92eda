"""A tiny Lightning job for the elastic tests (the Lightning twin of hf_job.py).

argv: RUN_DIR MAX_STEPS. Same data, model, global batch 8 (micro-batch 2), files
and hold at step 3 as hf_job.py; Adam with a linear learning-rate decay per step.
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist

from elastic_events import current_event, is_elastic, restart_reason
from elastic_events.integrations.lightning import ElasticCallback, elastic_resume_checkpoint

GLOBAL_BATCH, MICRO_BATCH, HOLD_AT, HOLD_TIMEOUT = 8, 2, 3, 120.0
run, max_steps = Path(sys.argv[1]), int(sys.argv[2])


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "idx": i}


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[int] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch["idx"].tolist()
        loss = torch.nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["y"])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class Record(L.Callback):
    """Sample ids and mean loss per optimizer step; the hold that lets a test make its scale event."""

    def __init__(self) -> None:
        self.last = -1

    def on_train_start(self, trainer, module) -> None:
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.last:
            return
        self.last = step
        rank, world = trainer.global_rank, trainer.world_size
        with open(run / f"samples-{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": world, "ids": sorted(module.seen)}) + "\n")
        loss = torch.stack(module.losses).sum().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(loss)
        count = len(module.losses) * world
        module.seen, module.losses = [], []
        if rank == 0:
            with open(run / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "world": world, "loss": loss.item() / count}) + "\n")
        if is_elastic() and restart_reason() == "start" and step == HOLD_AT:
            (run / f"held-{rank}").touch()
            deadline = time.monotonic() + HOLD_TIMEOUT
            while current_event() is None:  # the test adds or removes a node; the launcher picks a target step
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no scale event announced within {HOLD_TIMEOUT:g}s of holding at step {HOLD_AT}")
                time.sleep(0.02)


L.seed_everything(0, verbose=False)
elastic = ElasticCallback(dirpath=run / "ckpt", global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH)
distributed = "WORLD_SIZE" in os.environ
trainer = L.Trainer(
    accelerator="cpu", devices=1, num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    strategy="ddp" if distributed else "auto", max_steps=max_steps, callbacks=[elastic, Record()],
    use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip
trainer.fit(Regressor(), elastic.dataloader(Samples()), ckpt_path=elastic_resume_checkpoint(run / "ckpt"))
