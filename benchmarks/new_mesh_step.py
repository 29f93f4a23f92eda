"""The first training step on a mesh new to the process, with torch's ``clip_grad_norm_`` and with
``elastic_events.clip_grad_norm_`` (the global norm from the local shards).

A scale event with HSDP or FSDP builds a mesh the process has not seen (a survivor at a new shape; a joiner
always). DTensor then computes a sharding propagation for every op and shape of the first step before it
caches them; the example's model on a CPU spends seconds there, most of it in the gradient clip's DTensor
ops (``_foreach_norm``, ``_foreach_mul_``) and the rest in the fused optimizer's. That first step is part
of every survivor's pause.

``--world`` gloo ranks (processes of this script), the example's model (``--model``, fp32) under FSDP2
``fully_shard`` per block and root on a ``("replicate", "shard")`` mesh of ``--replicas`` replicas, fused
AdamW, gradient clip 1.0. Each repetition builds a fresh mesh for each variant whose dimension names no
earlier mesh had (so no propagation is cached for it), builds and initialises the model on it, and times its
first step and then ``--steps`` more. Variants alternate their order every repetition; the first repetition
is a warm-up and not counted. Reported per variant: the first step and a steady step (median), and
``local / torch`` ratios with their 95 % interval over the repetitions. Both variants train the same batch
from the same weights; the steps' gradient norms are checked to agree (rtol 1e-5).

    python benchmarks/new_mesh_step.py [--quick | --smoke] [--world 4] [--replicas 2] [--reps N] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    BenchmarkError,
    BenchmarkResult,
    format_table,
    free_port,
    median,
    parse_args,
    pyplot,
    ratio_ci,
)

NAME = "new_mesh_step"
VARIANTS = ("torch", "local")
EXAMPLE_DIR = REPO_ROOT / "examples" / "llama_finetune"
REPS = {"smoke": 3, "quick": 7, "full": 13}  # the first is a warm-up
STEPS = {"smoke": 1, "quick": 4, "full": 6}


def _model(name: str, mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    from model import Llama, LlamaConfig  # examples/llama_finetune/model.py

    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-4, fused=True)


def _step(model: Any, opt: Any, batch: Any, variant: str) -> float:
    """One training step; returns the gradient norm before clipping."""
    import torch

    from elastic_events import clip_grad_norm_

    out = model(batch, batch)
    out.loss.loss_sum.backward()
    if variant == "local":
        norm = clip_grad_norm_(model.parameters(), 1.0)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def _rank(rank: int, world: int, port: int, replicas: int, model_name: str, reps: int, steps: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    records = []
    for rep in range(reps):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            names = ("replicate", f"shard_{rep}_{variant}")  # a mesh unequal to every earlier one: nothing cached
            mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=names)
            model, opt = _model(model_name, mesh)
            dist.barrier()
            times, norms = [], []
            for _ in range(1 + steps):
                start = time.perf_counter()
                norms.append(_step(model, opt, batch, variant))
                dist.barrier()  # every rank's step over: the slowest rank's time
                times.append(time.perf_counter() - start)
            records.append({"rep": rep, "variant": variant, "first_s": times[0], "steady_s": times[1:], "norms": norms})
            del model, opt
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    dist.destroy_process_group()


def measure(*, world: int, replicas: int, model: str, reps: int, steps: int, work: Path) -> list[dict[str, Any]]:
    import json

    import torch.multiprocessing as mp

    out = work / "records.json"
    mp.spawn(_rank, args=(world, free_port(), replicas, model, reps, steps, str(out)), nprocs=world)
    return json.loads(out.read_text())


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    counted = [r for r in records if r["rep"] > 0]
    by = {(r["rep"], r["variant"]): r for r in counted}
    reps = sorted({r["rep"] for r in counted})
    for rep in reps:
        a, b = by[(rep, "torch")]["norms"], by[(rep, "local")]["norms"]
        if any(abs(x - y) > 1e-5 * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True)):
            raise BenchmarkError(f"repetition {rep}: the gradient norms differ: torch {a}, local {b}")
    first = {key: r["first_s"] for key, r in by.items()}
    steady = {key: median(r["steady_s"]) for key, r in by.items()}
    summary: dict[str, Any] = {"reps_counted": len(reps)}
    for figure, seconds in (("first_step", first), ("steady_step", steady)):
        for v in VARIANTS:
            summary[f"{v}_{figure}_s"] = round(median(seconds[(rep, v)] for rep in reps), 4)
        ci = ratio_ci([seconds[(rep, "local")] / seconds[(rep, "torch")] for rep in reps])
        summary[f"{figure}_local_over_torch"] = {k: round(v, 4) for k, v in ci.items()}
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(VARIANTS))
    ax.bar([i - 0.2 for i in x], [summary[f"{v}_first_step_s"] for v in VARIANTS], width=0.4, label="first step")
    ax.bar([i + 0.2 for i in x], [summary[f"{v}_steady_step_s"] for v in VARIANTS], width=0.4, label="steady step")
    ax.set_xticks(list(x), [f"{v} clip" for v in VARIANTS])
    ax.set_ylabel("s (median)")
    ax.set_title("A step on a mesh new to the process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--world", type=int, default=4, help="gloo ranks [4]")
        p.add_argument(
            "--replicas",
            type=int,
            default=2,
            help="HSDP replicas; 1: FSDP over the world [2: the HSDP benchmarks' 2 x 2]",
        )
        p.add_argument("--model", default="tiny", help="the example's preset [tiny]")
        p.add_argument("--reps", type=int, default=None, help="repetitions, the first a warm-up (smoke 3, quick 7)")
        p.add_argument("--steps", type=int, default=None, help="steady steps timed after the first (smoke 1, quick 4)")

    ns = parse_args(__doc__.splitlines()[0], add_arguments=options, argv=argv)
    reps, steps = ns.reps or REPS[ns.mode], ns.steps or STEPS[ns.mode]
    if ns.world < 1 or ns.replicas < 1 or ns.world % ns.replicas or reps < 3 or steps < 1:
        raise SystemExit(
            "new_mesh_step.py: --world must be a multiple of --replicas (both >= 1), --reps >= 3 and --steps >= 1"
        )
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=ns.tag,
        params={"world": ns.world, "replicas": ns.replicas, "model": ns.model, "reps": reps, "steps": steps},
        baseline="the same steps with torch.nn.utils.clip_grad_norm_, interleaved in the same processes",
        notes=[
            "Each variant's mesh is new to the process (its own dimension names), so DTensor computes every "
            "sharding propagation of its first step; the first repetition is a warm-up and not counted.",
        ],
    )
    ns.out.mkdir(parents=True, exist_ok=True)
    work = ns.out / "work" / NAME
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    records = measure(world=ns.world, replicas=ns.replicas, model=ns.model, reps=reps, steps=steps, work=work)
    result.samples = {"records": records}
    result.summary = summary = summarize(records)
    path = result.write(ns.out)
    try:
        plot(summary, result.plot_path(ns.out))
    except ImportError as exc:
        print(f"{NAME}: no plot ({exc})", file=sys.stderr)
    rows = [[v, summary[f"{v}_first_step_s"], summary[f"{v}_steady_step_s"]] for v in VARIANTS]
    print(format_table(["clip", "first step s", "steady step s"], rows))
    for figure in ("first_step", "steady_step"):
        ci = summary[f"{figure}_local_over_torch"]
        print(f"{figure} local / torch: {ci['ratio']:.3f} (95 % CI {ci['ci_low']:.3f}-{ci['ci_high']:.3f})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
