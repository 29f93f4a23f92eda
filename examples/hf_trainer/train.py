"""Elastic Hugging Face Trainer: a tiny GPT-2 trained on this repository's own docs, bytes as tokens.

Nothing is downloaded: the model is built from a config, the corpus is the Markdown
files next to this example, the tokenizer is "one byte, one token". The lines that
make it elastic are marked ``# elastic``.

Run it::

    # one process, no launcher
    python examples/hf_trainer/train.py --output-dir /tmp/hf-elastic

    # the same under torchrun (fixed size)
    torchrun --nproc-per-node 2 examples/hf_trainer/train.py --output-dir /tmp/hf-elastic

    # elastic, 1 to 2 nodes on this machine: start one launcher, then a second one in another
    # terminal (the job grows to 2 at the next agreed step); Ctrl-C the second to shrink back to 1
    hyperpodrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        --rdzv-id hf-demo examples/hf_trainer/train.py --output-dir /tmp/hf-elastic

At a scale event the ranks that stay keep their process: the Trainer stops at the
agreed step, the process group is rebuilt for the new world, a joining node's rank
receives the model, optimizer, scheduler and trainer state from a survivor in memory,
and training goes on with the same global batch (``--global-batch``) and the same data
order. With ``hyperpodrun --restart-mode process`` (or a plain ``Trainer``, or without
``elastic_init()``) every event saves the Trainer's own ``checkpoint-<step>`` and
restarts the script, which resumes from it at the new world size instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

from elastic_events.integrations.transformers import (  # elastic
    ElasticCallback,
    ElasticTrainer,
    elastic_init,
    elastic_resume_checkpoint,
    set_global_batch,
)

ROOT = Path(__file__).resolve().parents[2]


class ByteBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of the bytes of the repository's Markdown files."""

    def __init__(self, block: int) -> None:
        text = b"\n".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.blocks = tokens[: len(tokens) // block * block].view(-1, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks")
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--max-steps", type=int, default=100)
    args = parser.parse_args()

    set_seed(0)  # the initial weights, the same on every rank and in every run
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.block, n_embd=32, n_layer=2, n_head=2))
    dataset = ByteBlocks(args.block)
    elastic_init()  # elastic: a pre-warmed joining rank waits here until the job admits it
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_batch,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        warmup_steps=10,
        logging_steps=10,
        save_steps=100,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    set_global_batch(training, args.global_batch)  # elastic: accumulation for this world size
    trainer = ElasticTrainer(  # elastic: in-place scale events; each epoch in whole global batches
        model=model,
        args=training,
        train_dataset=dataset,
        callbacks=[ElasticCallback(global_batch=args.global_batch)],  # elastic
    )
    result = trainer.train(resume_from_checkpoint=elastic_resume_checkpoint(training.output_dir))  # elastic
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} steps, final training loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
