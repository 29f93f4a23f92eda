"""A stand-in trainer on the in-process API: ranks survive scale events, newcomers hydrate from peers.

argv: RUN_DIR [fsdp|hsdp [die-sending-at=N|die-in-reduction-at=N]]. A tiny linear model trained by DDP (or
FSDP2, sharded over the ranks; or HSDP, sharded over a node's ranks, replicated across nodes) with SGD and
momentum on data derived from the step number, so the parameters depend only on how many steps were
trained. Failure injectors, for rank 1 of the first round: ``die-sending-at=N`` kills it half-way through
sending its in-memory snapshot of step N (``elastic_events.rounds.snapshot``); ``die-in-reduction-at=N``
kills it as step N's backward starts its cross-replica all-reduce (HSDP), after the reduce-scatter
inside its replica. Rank 0 appends {"step", "world", "ts"} to
RUN_DIR/progress.jsonl every step; every rank appends {"pid", "rank", "world", "round", "step",
"how"} to RUN_DIR/worlds.jsonl when it starts and after every reconfiguration, and its final
parameters to RUN_DIR/final.jsonl; every build of the model appends {"pid", "loaded_over"} to RUN_DIR/builds.jsonl
(NaN parameters when the state is loaded over it). Training ends at the first step after RUN_DIR/stop exists
(agreed through an all-reduce); while RUN_DIR/block exists, the first rank 0 blocks for good at the start
of its next step (appending {"pid", "step"} to RUN_DIR/blocked.jsonl). A step is a few ms of gloo and a pause of
STEP_PAUSE_S, several times faster than the launcher's monitor interval in the tests, and a rank leaves most of
its core to the processes that start beside it (spares, joiners, replacements) on a 2-core machine. A step whose
collective fails (a peer was killed) is recovered in place: "how" is "recovered" for a survivor.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_events import ElasticConfig, ElasticTraining, HSDPConfig, elastic_event_detected, state_will_be_loaded

run = Path(sys.argv[1])
HSDP = sys.argv[2:3] == ["hsdp"]  # sharded over a node's ranks, replicated across nodes
FSDP = sys.argv[2:3] == ["fsdp"] or HSDP
INJECT, _, AT = (sys.argv[3] if sys.argv[3:] else "none=-1").partition("=")
DIE_SENDING_AT = int(AT) if INJECT == "die-sending-at" else -1
DIE_IN_REDUCTION_AT = int(AT) if INJECT == "die-in-reduction-at" else -1
STEP_PAUSE_S = 0.005


def log(name: str, record: dict) -> None:
    with open(run / name, "a") as f:
        f.write(json.dumps(record) + "\n")


def build() -> torch.nn.Module:
    """The model; NaN where ElasticTraining loads the kept state over it (a parameter it missed trains NaN)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    loaded_over = state_will_be_loaded()
    log("builds.jsonl", {"pid": os.getpid(), "loaded_over": loaded_over})
    if loaded_over:
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
    return model


def die_half_way_through_the_next_snapshot() -> None:
    """Its header goes out, then the process is killed before the first bucket of its tensors (``isend``,
    which only the snapshot's sender thread uses)."""
    import signal

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    dist.isend = die


def die_in_the_cross_replica_reduction() -> None:
    """FSDP2's HSDP reduces gradients with ``dist.all_reduce`` over the replicate group (the world's other
    collectives here are on the default group): the process is killed as that call starts."""
    import signal

    all_reduce = dist.all_reduce

    def die_on_the_replicate_group(tensor, *args, group=None, **kwargs):
        if group is not None and group is not dist.group.WORLD:
            os.kill(os.getpid(), signal.SIGKILL)
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = die_on_the_replicate_group


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


elastic = ElasticTraining(
    model_fn=build,
    wrap=shard if FSDP and not HSDP else None,  # HSDP: the default, fully_shard on the round's mesh
    optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    config=ElasticConfig(hsdp=HSDPConfig()) if HSDP else None,
).start()


def note(how: str) -> None:
    log(
        "worlds.jsonl",
        {
            "pid": os.getpid(),
            "rank": elastic.rank,
            "world": elastic.world_size,
            "round": elastic.round,
            "step": elastic.step,
            "how": how,
        },
    )


note(elastic.resumed_from)
while True:
    try:  # every collective of the step comes before the optimizer's update: a step that fails changes nothing
        if elastic.rank == 0 and elastic.resumed_from == "fresh" and (run / "block").exists():
            log("blocked.jsonl", {"pid": os.getpid(), "step": elastic.step})
            os.read(os.pipe()[0], 1)  # a main thread that never returns, like a collective gloo never ends
        if elastic.step == DIE_IN_REDUCTION_AT and elastic.rank == 1 and elastic.resumed_from == "fresh":
            die_in_the_cross_replica_reduction()
        stop = torch.tensor([float((run / "stop").exists())])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
        g = torch.Generator().manual_seed(elastic.step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        rows = x.tensor_split(elastic.world_size)[elastic.rank] if elastic.world_size <= 8 else x[:0]
        target = y.tensor_split(elastic.world_size)[elastic.rank] if elastic.world_size <= 8 else y[:0]
        loss = (elastic.model(rows) - target).square().sum() * elastic.world_size / 8
        loss.backward()
        elastic.optimizer.step()  # with snapshots, waits for every copy of the last one (a dead peer: raises)
    except RuntimeError as exc:  # a peer died mid-step: the launcher repairs the group in place
        if not elastic.recover(exc):
            note("left")
            break
        note("recovered")
        continue
    elastic.optimizer.zero_grad()
    elastic.step += 1
    time.sleep(STEP_PAUSE_S)
    if elastic.step == DIE_SENDING_AT and elastic.rank == 1 and elastic.resumed_from == "fresh":
        die_half_way_through_the_next_snapshot()
    if elastic.rank == 0:
        log("progress.jsonl", {"step": elastic.step, "world": elastic.world_size, "ts": time.time()})
    if elastic_event_detected():
        if not elastic.reconfigure():
            note("left")
            break
        note("reconfigured")
if elastic.module is not None:  # a rank that left a sharded round handed its shards on: it holds none
    params = [(p.full_tensor() if FSDP else p).detach().flatten().tolist() for p in elastic.module.parameters()]
    log("final.jsonl", {"rank": elastic.rank, "step": elastic.step, "params": params})
elastic.close()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip interpreter finalization: torch's gloo teardown can abort there (SIGABRT, pytorch/pytorch#179291)
