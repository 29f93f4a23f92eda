"""Rank starts by ``--start-method``: fresh processes (``spawn``, the default) against forks of the node's server.

One node of the example trainer (tiny Llama by default) with ``--nproc-per-node`` ranks under
``hyperpodrun --standalone --max-restarts 1``. In every run, once step ``--kill-at`` is logged, one
rank is killed (SIGKILL); the launcher stops the other and starts every rank again (the restart path,
which also starts a job the first time). Measured per run:

- ``start_s``: the launcher's start to the end of the first step (the trainer's ``--metrics`` log);
- ``restart_s``: the kill to the end of the first step after it;
- ``cpu_s``: CPU-seconds of the launcher and every process under it, over the whole run.

Runs alternate ``spawn`` and ``forkserver`` (one pair per rep, the order flipped every other rep), and
each figure is reported as the ratio forkserver / spawn of a pair: the geometric mean of the pairs with
its 95 % interval. The baseline is the ``spawn`` run of the same pair.

    python benchmarks/start_method.py [--quick | --smoke] [--nproc 2] [--kill-at 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    BenchmarkError,
    BenchmarkResult,
    ManagedProcess,
    TrainArgs,
    add_train_arguments,
    bench_env,
    format_table,
    median,
    parse_args,
    pyplot,
    ratio_ci,
    read_metrics,
    result_tag,
    single_node_cmd,
)

NAME = "start_method"
METHODS = ("spawn", "forkserver")
REPS = {"smoke": 2, "quick": 5, "full": 10}
STEPS = {"smoke": 5, "quick": 6, "full": 8}
FIGURES = ("start_s", "restart_s", "cpu_s")
POLL_S = 0.02


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _rank_pids(events: Path) -> dict[str, int]:
    """The pids of the ranks the launcher started last (its event log's ``workers_started``)."""
    pids: dict[str, int] = {}
    if events.exists():
        for line in events.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "workers_started":
                pids = record["pids"]
    return pids


def run_once(
    method: str, *, nproc: int, kill_at: int, train: TrainArgs, work: Path, data_cache: Path, timeout: float
) -> dict[str, Any]:
    """One run: started, one rank killed after step ``kill_at``, restarted, trained to the end."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    events = work / "events.jsonl"
    cmd = single_node_cmd(
        "hyperpodrun",
        nproc,
        train,
        work=work,
        data_cache=data_cache,
        launcher_args=("--max-restarts", "1", "--start-method", method, "--event-log", str(events)),
    )
    cpu_before = _children_cpu_s()
    deadline = time.monotonic() + timeout
    with ManagedProcess(cmd, name=f"{method}", env=bench_env(), log_path=work / "output.log") as proc:
        started = proc.started_at
        while not any(m["step"] >= kill_at for m in read_metrics(work / "metrics.jsonl")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchmarkError(f"{method}: no step {kill_at} logged; output tail:\n{proc.tail()}")
            time.sleep(POLL_S)
        victim = _rank_pids(events).get(str(nproc - 1))
        if victim is None:
            raise BenchmarkError(f"{method}: no workers_started record with local rank {nproc - 1} in {events}")
        killed = time.time()
        os.killpg(victim, signal.SIGKILL)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    if code != 0:
        raise BenchmarkError(f"{method}: the launcher exited {code}; output tail:\n{proc.tail()}")
    fallback = [line.text for line in proc.lines() if "fork server" in line.text]
    if fallback:  # a forkserver run whose ranks started as fresh processes measures spawn
        raise BenchmarkError(f"{method}: the launcher did not fork every rank: {fallback[0]}")
    metrics = read_metrics(work / "metrics.jsonl")
    after = [m["ts"] for m in metrics if m["ts"] > killed]
    if not after or metrics[-1]["step"] != train.steps:
        raise BenchmarkError(
            f"{method}: {len(metrics)} step records, none after the kill or not ending at {train.steps}"
        )
    return {
        "method": method,
        "start_s": metrics[0]["ts"] - started,
        "restart_s": after[0] - killed,
        "cpu_s": _children_cpu_s() - cpu_before,
        "victim": victim,
    }


def plot(result: BenchmarkResult, runs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), 3.5))
    for ax, figure in zip(axes, FIGURES):
        ax.boxplot([[r[figure] for r in runs if r["method"] == m] for m in METHODS], tick_labels=list(METHODS))
        ax.set_title(figure)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"start_method ({result.mode}, {result.params['nproc']} ranks, {result.params['train']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nproc", type=int, default=2, help="ranks on the node [2]")
        parser.add_argument("--kill-at", type=int, default=3, help="the step after which a rank is killed [3]")
        parser.add_argument("--reps", type=int, default=None, help="spawn/forkserver pairs (default by mode)")
        parser.add_argument("--run-timeout", type=float, default=300.0, help="hard limit per run, s")
        add_train_arguments(parser)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    reps = args.reps or REPS[args.mode]
    if reps < 2:
        raise SystemExit("--reps must be >= 2: the ratios need an interval")
    if args.nproc < 2:
        raise SystemExit("--nproc must be >= 2: one rank is killed while another runs")
    train = TrainArgs.from_namespace(args, steps=STEPS[args.mode])
    if not 1 <= args.kill_at < train.steps:
        raise SystemExit(f"--kill-at must be in [1, {train.steps - 1}]")
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={"nproc": args.nproc, "kill_at": args.kill_at, "reps": reps, "train": train.as_params()},
        baseline="the spawn run of the same pair (fresh processes, the default)",
    )
    work_root = args.out / "work" / NAME
    data_cache = args.out / "data-cache"
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        for method in order:
            print(f"{NAME}: {method}, rep {rep + 1}/{reps} ...", flush=True)
            run = run_once(
                method,
                nproc=args.nproc,
                kill_at=args.kill_at,
                train=train,
                work=work_root / f"{method}-r{rep}",
                data_cache=data_cache,
                timeout=args.run_timeout,
            )
            runs.append({"rep": rep, **run})
    by = {(r["rep"], r["method"]): r for r in runs}
    summary: dict[str, Any] = {"nproc": args.nproc}
    for figure in FIGURES:
        for method in METHODS:
            summary[f"{method}_{figure}_median"] = median(r[figure] for r in runs if r["method"] == method)
        summary[f"{figure}_ratio_ci"] = ratio_ci(
            [by[(rep, "forkserver")][figure] / by[(rep, "spawn")][figure] for rep in range(reps)]
        )
    result.samples["runs"] = runs
    result.summary = summary
    result.notes.append(
        f"This machine has {len(os.sched_getaffinity(0))} usable cores. A spawn start imports torch in every rank at "
        "once; a forkserver start imports it once in the server, which runs while the launcher forms the round."
    )
    plot(result, runs, result.plot_path(args.out))
    path = result.write(args.out)
    print(
        format_table(
            ["figure", "spawn (median)", "forkserver (median)", "forkserver / spawn", "95 % interval"],
            [
                (
                    figure,
                    summary[f"spawn_{figure}_median"],
                    summary[f"forkserver_{figure}_median"],
                    summary[f"{figure}_ratio_ci"]["ratio"],
                    f"{summary[f'{figure}_ratio_ci']['ci_low']:.2f}-{summary[f'{figure}_ratio_ci']['ci_high']:.2f}",
                )
                for figure in FIGURES
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
