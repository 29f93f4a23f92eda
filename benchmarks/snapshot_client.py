"""``step_overhead.py --client snapshot``: what in-memory snapshots of a sharded model cost a step.

The example trainer with ``--fsdp`` (FSDP2 over 2 ranks, gloo, CPU) under hyperpodrun twice,
in interleaved pairs: ``--snapshot-every auto`` (the default: a snapshot's shards stream to the
peer that holds them while the next step computes, the next optimizer step waits for the chain, and
each round times its first snapshots and picks the interval that keeps their cost under 2 % of the
step; ``--variant every-step`` measures ``--snapshot-every 1`` instead) and ``--snapshot-every 0``
(none). Per pair: the ratio of the median step times and of the CPU time per step (off / on: < 1 is
the cost), their geometric mean and 95 % CI; target: throughput with snapshots >= 0.98 of without
under ``auto`` (0.97 every step). The intervals ``auto`` chose are kept beside it. Memory: bytes of snapshot buffers each rank holds (its peer's two
newest copies and its own) over the bytes of its local state (shards of parameters and optimizer
state), from rank 0's metrics.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common import (
    BenchmarkError,
    BenchmarkResult,
    TrainArgs,
    bench_env,
    first_record_ts,
    median,
    ratio_ci,
    records,
    result_tag,
    run_training,
)

NAME = "step_overhead_snapshot"
INTERVALS = {"auto": "auto", "every-step": "1"}  # --variant: what the snapshot runs use
TARGETS = {"auto": 0.98, "every-step": 0.97}
RANKS = 2


def run(
    args: argparse.Namespace, work: Path, *, steps: int, reps: int, skip: int, steady_costs: Any
) -> BenchmarkResult:
    interval = getattr(args, "variant", None) or "auto"
    variants = {"snapshots": ("--snapshot-every", INTERVALS[interval]), "no-snapshots": ("--snapshot-every", "0")}
    base = TrainArgs.from_namespace(args, steps=steps)
    train = TrainArgs(**{**base.__dict__, "extra": (*base.extra, "--fsdp")})
    # Made before the runs: its start time, load and versions are those of the run.
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args) or ("" if interval == "auto" else interval.replace("-", "_")),
        params={"train": train.as_params(), "ranks": RANKS, "reps": reps, "warmup_steps": skip, "variants": variants},
        baseline="the same FSDP2 job under hyperpodrun with --snapshot-every 0, in interleaved pairs",
    )
    env = bench_env(OMP_NUM_THREADS="1")
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        order = tuple(variants) if rep % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            print(f"{NAME}: {variant}, {RANKS} ranks (FSDP2), rep {rep + 1} ...", flush=True)
            done = run_training(
                "hyperpodrun",
                RANKS,
                train,
                work=work / f"{variant}-{rep}",
                data_cache=args.out / "data-cache",
                timeout=args.run_timeout,
                env=env,
                sample_interval=0.2,
                launcher_args=variants[variant],
            )
            spare_ready = first_record_ts(work / f"{variant}-{rep}" / "logs", "spare_ready")
            costs = steady_costs(done["metrics"], done["cpu_samples"], skip=skip, after_ts=spare_ready)
            last = done["metrics"][-1]
            runs.append(
                {
                    "variant": variant,
                    "rep": rep,
                    **costs,
                    "state_bytes": last.get("snapshot_state_bytes"),
                    "held_bytes": last.get("snapshot_held_bytes"),
                    "intervals": [
                        {k: r.get(k) for k in ("every", "cost_s", "step_s", "overhead", "rule")}
                        for r in records(work / f"{variant}-{rep}" / "logs", "snapshot_interval")
                    ],
                    "wall_s": done["wall_s"],
                }
            )
    on = sorted((r for r in runs if r["variant"] == "snapshots"), key=lambda r: r["rep"])
    off = sorted((r for r in runs if r["variant"] == "no-snapshots"), key=lambda r: r["rep"])
    if not on[0]["state_bytes"]:
        raise BenchmarkError("the snapshot runs logged no snapshot bytes: were snapshots taken? (--fsdp, hyperpodrun)")
    wall = [a["median_step_s"] / b["median_step_s"] for a, b in zip(off, on)]
    cpu = [a["cpu_per_step_s"] / b["cpu_per_step_s"] for a, b in zip(off, on)]
    result.samples["runs"] = runs
    result.summary = {
        "median_step_s": {
            "snapshots": median(r["median_step_s"] for r in on),
            "no-snapshots": median(r["median_step_s"] for r in off),
        },
        "cpu_per_step_s": {
            "snapshots": median(r["cpu_per_step_s"] for r in on),
            "no-snapshots": median(r["cpu_per_step_s"] for r in off),
        },
        "wall_step_ratios": wall,
        "cpu_step_ratios": cpu,
        "throughput_ratio": median(wall),
        "wall_step_ratio_ci": ratio_ci(wall) if len(wall) >= 2 else None,
        "cpu_step_ratio_ci": ratio_ci(cpu) if len(cpu) >= 2 else None,
        "state_bytes_per_rank": on[0]["state_bytes"],
        "snapshot_bytes_per_rank": on[0]["held_bytes"],
        "memory_ratio": on[0]["held_bytes"] / on[0]["state_bytes"],
        "snapshot_every": INTERVALS[interval],
        "chosen_intervals": sorted({i["every"] for r in on for i in r["intervals"]}),
        "chosen_overheads": [i["overhead"] for r in on for i in r["intervals"]],
        "target_throughput_ratio": TARGETS[interval],
    }
    result.notes.append(
        "Memory: each rank holds its peer's two newest copies and its own (3x its local state, padding "
        "aside); see elastic_events/snapshot.py for why two copies at the peer and one's own."
    )
    return result
