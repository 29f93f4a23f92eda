"""A tiny Lightning job for the elastic tests (the Lightning twin of hf_job.py).

argv: RUN_DIR MAX_STEPS [MODE [hsdp]]. Same data, model, global batch 8 (micro-batch 2), files,
hold at step 8 and modes as hf_job.py; Adam with a linear learning-rate decay per step.
MODE ``in_place`` adds ``elastic_init()`` and fits through ``ElasticCallback.fit``. ``hsdp``: Lightning's
``ModelParallelStrategy``, the model sharded over a node's ranks and replicated across nodes
(``fully_shard`` on the round's ``("replicate", "shard")`` mesh, :func:`hsdp_mesh`).
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from job_common import GLOBAL_BATCH, MICRO_BATCH, Samples, end_of_training, hold_for_event, log_step

from elastic_events.integrations.lightning import ElasticCallback, elastic_init, elastic_resume_checkpoint, hsdp_mesh

run, max_steps = Path(sys.argv[1]), int(sys.argv[2])
in_place = (sys.argv[3] if len(sys.argv) > 3 else "restart") == "in_place"
hsdp = sys.argv[4:5] == ["hsdp"]


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

    def configure_model(self) -> None:
        if hsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = hsdp_mesh(self.trainer)
            fully_shard(self.linear, mesh=mesh)
            with open(run / f"mesh-{self.trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"world": self.trainer.world_size, "shape": list(mesh.shape)}) + "\n")

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class Record(L.Callback):
    """Sample ids and the mean loss over the global batch per optimizer step."""

    def __init__(self) -> None:
        self.last = -1

    def on_train_start(self, trainer, module) -> None:
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.last:
            return  # inside an accumulation
        self.last = step
        loss = torch.stack(module.losses).sum().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(loss)
        mean = loss.item() / (len(module.losses) * trainer.world_size)
        rank = trainer.global_rank
        log_step(run, rank=rank, world=trainer.world_size, step=step, ids=module.seen, loss=mean if rank == 0 else None)
        module.seen, module.losses = [], []
        hold_for_event(run, rank=rank, step=step, world=trainer.world_size)


L.seed_everything(0, verbose=False)
model = Regressor()
if in_place:
    elastic_init()  # a pre-warmed joiner waits here for its admission
elastic = ElasticCallback(dirpath=run / "ckpt", global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH)
distributed = "WORLD_SIZE" in os.environ
if hsdp:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
else:
    strategy = "ddp" if distributed else "auto"
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    strategy=strategy,
    max_steps=max_steps,
    callbacks=[elastic, Record()],
    use_distributed_sampler=False,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
loader = elastic.dataloader(Samples(target="y"))
if in_place:
    elastic.fit(trainer, model, loader, ckpt_path=elastic_resume_checkpoint(run / "ckpt"))
else:
    trainer.fit(model, loader, ckpt_path=elastic_resume_checkpoint(run / "ckpt"))
end_of_training(run)
