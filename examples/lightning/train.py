"""Elastic Lightning: a tiny character-level MLP language model on this repository's docs.

Nothing is downloaded: the corpus is the Markdown files under docs/, the tokens are
bytes. The lines that make it elastic are marked ``# elastic``.

Run it::

    # one process, no launcher
    python examples/lightning/train.py --ckpt-dir /tmp/pl-elastic

    # elastic, 1 to 2 nodes on this machine: start one launcher, then a second one in another
    # terminal (the job grows to 2 at the next agreed step); Ctrl-C the second to shrink back to 1
    hyperpodrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        --rdzv-id pl-demo examples/lightning/train.py --ckpt-dir /tmp/pl-elastic

At a scale event the ranks that stay keep their process: ``fit`` stops at the agreed
step, the process group and the DDP wrapper are rebuilt for the new world, a joining
node's rank receives Lightning's checkpoint from a survivor in memory, and ``fit`` goes
on with the same global batch and the same data order. With ``hyperpodrun
--restart-mode process`` (or ``trainer.fit`` instead of ``elastic.fit``, or without
``elastic_init()``) every event saves a Lightning checkpoint in ``--ckpt-dir`` and
restarts the script, which resumes from it instead. ``lightning.pytorch`` is used, or
``pytorch_lightning``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

try:
    import lightning.pytorch as L
except ImportError:
    import pytorch_lightning as L  # type: ignore[no-redef]

from elastic_events.integrations.lightning import ElasticCallback, elastic_init, elastic_resume_checkpoint  # elastic

ROOT = Path(__file__).resolve().parents[2]


class NextByte(torch.utils.data.Dataset):
    """(context of ``width`` bytes, next byte) pairs from the repository's Markdown files."""

    def __init__(self, width: int) -> None:
        text = b"\n".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.width = width

    def __len__(self) -> int:
        return len(self.tokens) - self.width

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i : i + self.width], self.tokens[i + self.width]


class ByteMLP(L.LightningModule):
    def __init__(self, width: int, dim: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(256, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width * dim, 128), torch.nn.GELU(), torch.nn.Linear(128, 256))

    def training_step(self, batch, batch_idx):
        context, target = batch
        loss = torch.nn.functional.cross_entropy(self.mlp(self.embed(context).flatten(1)), target)
        self.log("loss", loss, prog_bar=True, sync_dist=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, all ranks")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=8, help="context bytes")
    parser.add_argument("--max-steps", type=int, default=300)
    args = parser.parse_args()

    L.seed_everything(0)
    model, dataset = ByteMLP(args.width), NextByte(args.width)
    elastic_init()  # elastic: a pre-warmed joining rank waits here until the job admits it
    elastic = ElasticCallback(
        dirpath=args.ckpt_dir, global_batch=args.global_batch, micro_batch=args.micro_batch
    )  # elastic
    distributed = "WORLD_SIZE" in os.environ  # under a launcher
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if distributed else "auto",
        strategy="ddp" if distributed else "auto",
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
        callbacks=[elastic],  # elastic
        use_distributed_sampler=False,  # elastic: the elastic loader splits the data itself
    )
    elastic.fit(  # elastic: trainer.fit, through in-place scale events
        trainer,
        model,
        elastic.dataloader(dataset),  # elastic
        ckpt_path=elastic_resume_checkpoint(args.ckpt_dir),  # elastic
    )


if __name__ == "__main__":
    main()
