"""Throughput scaling: the example's tokens/s by world size, and efficiency against 1 rank.

The example trainer (tiny Llama by default, constant global batch) runs on one node with
1, 2 and 4 ranks under a launcher (hyperpodrun by default); throughput is end-to-end
(tokens of the steps after the warm-up divided by the time between their ends, read
from the trainer's ``--metrics`` log). Scaling efficiency at W ranks is
``tokens/s(W) / (W * tokens/s(1))``: the baseline is the 1-rank run of the same run.

On CPU every rank gets ``--threads-per-rank`` intra-op threads (1 by default), so W ranks
use W cores; where W exceeds the machine's cores the run oversubscribes them and the
result says so. On GPU nodes pass e.g. ``--worlds 1,2,4,8 --train-args "--fsdp"``:
each rank takes one GPU (NCCL, bf16 by train.py's defaults).

    python benchmarks/throughput.py [--quick | --smoke] [--worlds 1,2,4] [--launcher torchrun]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from common import (
    LAUNCHERS,
    BenchmarkResult,
    TrainArgs,
    add_train_arguments,
    bench_env,
    format_table,
    median,
    parse_args,
    pyplot,
    result_tag,
    run_training,
    wall_tokens_per_s,
)

NAME = "throughput"
WORLDS = {"smoke": (1, 2), "quick": (1, 2, 4), "full": (1, 2, 4)}
STEPS = {"smoke": 6, "quick": 12, "full": 40}
WARMUP_STEPS = {"smoke": 2, "quick": 3, "full": 5}
REPS = {"smoke": 1, "quick": 1, "full": 2}


def plot(result: BenchmarkResult, rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    worlds = [r["world"] for r in rows]
    ax1.plot(worlds, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    ax1.plot(worlds, [r["world"] * rows[0]["tokens_per_s"] for r in rows], "k--", alpha=0.5, label="linear from 1 rank")
    ax1.set_xlabel("ranks")
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput")
    ax1.legend()
    ax2.bar([str(w) for w in worlds], [r["efficiency"] for r in rows])
    ax2.axhline(1.0, color="k", linestyle="--", alpha=0.5)
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("tokens/s(W) / (W x tokens/s(1))")
    ax2.set_title("scaling efficiency")
    cores = result.machine["usable_cpus"]
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"throughput ({result.mode}, {result.params['launcher']}, {result.params['train']['model']}, "
        f"{cores} CPU cores{', GPUs' if result.machine['gpus'] else ''})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--worlds",
            type=lambda s: tuple(int(x) for x in s.split(",")),
            default=None,
            help="rank counts on this node (default by mode)",
        )
        parser.add_argument("--launcher", choices=LAUNCHERS, default="hyperpodrun")
        parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default by mode)")
        parser.add_argument("--threads-per-rank", type=int, default=1, help="OMP/intra-op threads per rank on CPU [1]")
        parser.add_argument("--run-timeout", type=float, default=600.0, help="hard limit per training run, s")
        add_train_arguments(parser)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    worlds = args.worlds or WORLDS[args.mode]
    if worlds[0] != 1:
        raise SystemExit("--worlds must start with 1: efficiency is measured against the 1-rank run")
    train = TrainArgs.from_namespace(args, steps=args.steps or STEPS[args.mode])
    skip = WARMUP_STEPS[args.mode]
    reps = REPS[args.mode]
    cores = len(os.sched_getaffinity(0))
    env = bench_env(OMP_NUM_THREADS=str(args.threads_per_rank))
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "worlds": list(worlds),
            "launcher": args.launcher,
            "reps": reps,
            "warmup_steps": skip,
            "threads_per_rank": args.threads_per_rank,
            "train": train.as_params(),
        },
        baseline="the 1-rank run of the same benchmark run (linear scaling = W x its tokens/s)",
    )
    work_root = args.out / "work" / NAME
    shutil.rmtree(work_root, ignore_errors=True)
    data_cache = args.out / "data-cache"
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for world in worlds:
            print(f"{NAME}: {world} rank(s), rep {rep + 1}/{reps} ...", flush=True)
            run = run_training(
                args.launcher,
                world,
                train,
                work=work_root / f"w{world}-r{rep}",
                data_cache=data_cache,
                timeout=args.run_timeout,
                env=env,
            )
            run["tokens_per_s"] = wall_tokens_per_s(run["metrics"], train.tokens_per_step, skip=skip)
            run["trainer_tokens_per_s_median"] = median(m["tokens_per_s"] for m in run["metrics"] if m["step"] > skip)
            runs.append({"world": world, "rep": rep, **run})
    rows = []
    for world in worlds:
        tps = median(r["tokens_per_s"] for r in runs if r["world"] == world)
        rows.append({"world": world, "tokens_per_s": tps, "oversubscribed": world * args.threads_per_rank > cores})
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["efficiency"] = row["speedup"] / row["world"]
    result.samples["runs"] = runs
    result.summary = {"by_world": rows, "cores": cores, "gpus": len(result.machine["gpus"])}
    if any(r["oversubscribed"] for r in rows):
        result.notes.append(
            f"This machine has {cores} usable cores: runs with more ranks x threads than that oversubscribe "
            "the CPU, so their efficiency measures time-sharing, not the launcher."
        )
    result.notes.append(
        "The global batch is constant (strong scaling): more ranks split the same samples, so "
        "per-rank work shrinks and fixed per-step costs (all-reduce, optimizer step, Python) weigh more."
    )
    plot(result, rows, result.plot_path(args.out))
    path = result.write(args.out)
    print(
        format_table(
            ["ranks", "tokens/s", "speedup", "efficiency", "oversubscribed"],
            [
                (r["world"], r["tokens_per_s"], r["speedup"], r["efficiency"], "yes" if r["oversubscribed"] else "no")
                for r in rows
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
