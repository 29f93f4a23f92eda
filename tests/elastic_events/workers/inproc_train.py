"""A tiny elastic training loop on ElasticTraining, as a user would write it (gloo, CPU).

Dumps its state with torch.save into --out at ``start``, right ``after`` each in-process
reconfiguration and at the ``end``: pid, rank, world, round, step, sampler and scheduler
state, parameters (full tensors for FSDP2, plus this rank's local shards) and
optimizer state (replicated models).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from elastic_events import ElasticConfig, ElasticTraining, HSDPConfig, elastic_event_detected
from elastic_events.checkpoint import CheckpointConfig, Checkpointer
from elastic_events.data.sampler import ElasticSampler

SAMPLES, FEATURES, GLOBAL_BATCH = 60, 4, 6


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Linear(5, 2)
    )


def fsdp_wrap(module: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """FSDP2 over the world, or HSDP on the round's mesh (``--hsdp``: ElasticTraining hands it over)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module[0], mesh=mesh)
    return fully_shard(module, mesh=mesh)


def full_optimizer_state(elastic: ElasticTraining) -> dict:
    """The FSDP2 optimizer state gathered to full tensors (collective), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(elastic.model, elastic.optimizer, options=options)


def dump(args: argparse.Namespace, elastic: ElasticTraining, tag: str) -> None:
    from torch.distributed.tensor import DTensor

    params, shards = {}, {}
    for name, p in elastic.model.named_parameters():
        if isinstance(p, DTensor):
            params[name] = p.full_tensor().detach().clone()
            shards[name] = p.to_local().detach().clone()
        else:
            params[name] = p.detach().clone()
    state = {
        "pid": os.getpid(),
        "rank": elastic.rank,
        "world_size": elastic.world_size,
        "round": elastic.round,
        "step": elastic.step,
        "extra": dict(elastic.extra),
        "sampler": elastic.sampler.state_dict(),
        "scheduler": elastic.scheduler.state_dict(),
        "params": params,
        "shards": shards,
        "optimizer": full_optimizer_state(elastic) if shards else elastic.optimizer.state_dict(),
        "plan": (elastic.sampler.rank, elastic.sampler.world_size),
    }
    state["state_bytes"] = elastic.snapshot_stats()["state_bytes"]  # this rank's local state (sharded models)
    node, local = os.environ["HYPERPODRUN_NODE_ID"], os.environ["LOCAL_RANK"]
    torch.save(state, args.out / f"{tag}-{node}-{local}.pt")
    if tag == "after":  # and kept per round: a later round's "after" replaces the file above
        torch.save(state, args.out / f"round{elastic.round}-{node}-{local}.pt")


def wait_for_gate(gate: Path | None, round: int) -> None:
    if gate is None:
        return
    deadline = time.monotonic() + 60
    while not (gate / f"go-{round}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {gate}/go-{round} within 60s")
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--hsdp", action="store_true", help="HSDP: shard over a node's ranks, replicate over nodes")
    p.add_argument("--ckpt-dir", type=Path, help="a Checkpointer: loaded at start, saved at a restart event")
    p.add_argument("--timeout", type=float, default=60.0, help="ElasticConfig.timeout_s")
    p.add_argument("--ckpt-every", type=int, default=0, help="save through the checkpointer every N steps")
    p.add_argument("--gate", type=Path, help="after joining round R, wait for GATE/go-R (the test's next move)")
    p.add_argument("--skew-step-of-rank", type=int, default=-1, help="this rank's step is off by one at the event")
    p.add_argument("--fp64", action="store_true", help="model, data and optimizer state in float64")
    p.add_argument("--ledger", type=Path, help="append {step, rank, world_size, samples} per trained step")
    args = p.parse_args()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 2, generator=g)
    if args.fp64:
        torch.set_default_dtype(torch.float64)  # build() makes float64 parameters
        x, y = x.double(), y.double()
    sampler = ElasticSampler(SAMPLES, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH, rank=0, world_size=1)
    elastic = ElasticTraining(
        model_fn=build,
        wrap=fsdp_wrap if args.fsdp or args.hsdp else None,
        optimizer_fn=lambda model: torch.optim.AdamW(model.parameters(), lr=0.05),
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95),
        sampler=sampler,
        checkpointer=Checkpointer(CheckpointConfig(dir=args.ckpt_dir, timeout_s=60)) if args.ckpt_dir else None,
        config=ElasticConfig(  # gloo; 104-byte buckets
            timeout_s=args.timeout, bucket_mb=0.0001, device="cpu", hsdp=HSDPConfig() if args.hsdp else None
        ),
    ).start()
    parked = os.environ.get("HYPERPODRUN_PARKED") == "1"
    dump(args, elastic, "after" if parked else "start")
    if parked:
        wait_for_gate(args.gate, elastic.round)
    while elastic.step < args.steps:
        loader = [i for i in sampler]  # this rank's micro-batches of the rest of the epoch (indices)
        for batch in sampler.steps(loader):
            idx = torch.tensor([i for mb in batch.micro_batches for i in mb], dtype=torch.long)
            out = elastic.model(x[idx])
            loss = (out - y[idx]).square().sum() * (elastic.world_size / batch.global_count)
            loss.backward()
            elastic.optimizer.step()
            elastic.optimizer.zero_grad()
            elastic.scheduler.step()
            sampler.mark_step()
            elastic.step += 1
            if args.ledger is not None:
                record = {"step": elastic.step, "rank": elastic.rank, "world_size": elastic.world_size}
                with open(args.ledger, "a") as f:
                    f.write(json.dumps({**record, "samples": idx.tolist()}) + "\n")
            elastic.extra["samples"] = elastic.extra.get("samples", 0) + batch.global_count
            event = elastic_event_detected()
            if event and elastic.rank == args.skew_step_of_rank:
                elastic.step += 1
            if event:
                if elastic.distributed and (args.fsdp or args.hsdp):
                    dump(args, elastic, "before")
                if not elastic.reconfigure():
                    print(f"left at step {elastic.step}", flush=True)
                    return 0
                dump(args, elastic, "after")
                wait_for_gate(args.gate, elastic.round)
                break
            if args.ckpt_every and elastic.step % args.ckpt_every == 0:
                elastic.save_checkpoint()
            if elastic.step >= args.steps:
                break
    dump(args, elastic, "end")
    elastic.close()
    return 0


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
