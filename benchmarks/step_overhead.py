"""Per-step overhead: ``elastic_event_detected()`` against a per-step all-reduce, and the
example's throughput under hyperpodrun against torchrun.

Micro: the cost of one ``elastic_event_detected()`` call when nothing is pending, timed
call by call (``perf_counter_ns``; the timer's own cost is measured and reported too):

* inside: 2 ranks started by hyperpodrun's elastic agent, so the control channel is
  live (the call counts a step in shared memory and reads the target);
* outside: a plain process (the call finds no channel and returns False);
* baseline, in the same ranks as "inside": the design AWS HyperPod uses, a one-element
  ``all_reduce`` per step, on gloo with 2 ranks (and on NCCL too where GPUs exist).

Macro: tokens/s of the example trainer with the same 2 ranks under hyperpodrun and under
torchrun, runs interleaved, end-to-end (step end times); target ratio >= 0.99.

``--client hf`` measures instead a Hugging Face Trainer job with ``ElasticCallback``
under hyperpodrun against the same job without it under torchrun (see hf_client.py).

    python benchmarks/step_overhead.py [--quick | --smoke] [--client hf]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_client
from common import (
    BenchmarkError,
    BenchmarkResult,
    TrainArgs,
    add_train_arguments,
    bench_env,
    format_table,
    free_port,
    hyperpodrun_cmd,
    median,
    parse_args,
    pyplot,
    run_to_completion,
    run_training,
    summarize,
    wall_tokens_per_s,
)

NAME = "step_overhead"
CHECK_CALLS = {"smoke": 20_000, "quick": 200_000, "full": 1_000_000}
ALLREDUCE_CALLS = {"smoke": 300, "quick": 3_000, "full": 20_000}
TRAIN_STEPS = {"smoke": 6, "quick": 14, "full": 40}
TRAIN_REPS = {"smoke": 1, "quick": 2, "full": 6}
WARMUP_STEPS = {"smoke": 2, "quick": 3, "full": 5}
RANKS = 2


# --------------------------------------------------------------------------- worker side


def time_calls(fn: Callable[[], object], calls: int) -> tuple[list[int], int]:
    """Nanoseconds of each of ``calls`` calls of ``fn``, and how many returned truthy."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    truthy = 0
    for i in range(calls):
        t0 = clock()
        r = fn()
        samples[i] = clock() - t0
        truthy += bool(r)
    return samples, truthy


def _stats_us(samples_ns: list[int]) -> dict[str, float]:
    s = summarize(samples_ns)
    return {f"{k}_us": (v / 1000.0 if k != "n" else v) for k, v in s.items()}


def worker_main(args: argparse.Namespace) -> int:
    """Time the check (and, with a process group, the all-reduce); write ``<out>/rank<r>.json``."""
    import torch

    import elastic_events

    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {"rank": rank, "elastic": elastic_events.is_elastic()}
    floor, _ = time_calls(lambda: None, args.calls)
    out["timer_floor"] = _stats_us(floor)
    for _ in range(1000):  # warm up: the first call opens and maps the control file
        elastic_events.elastic_event_detected()
    samples, true_count = time_calls(elastic_events.elastic_event_detected, args.calls)
    out["check"] = _stats_us(samples)
    out["check_returned_true"] = true_count
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            groups = {"gloo": (None, torch.device("cpu"))}
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                groups["nccl"] = (dist.new_group(backend="nccl"), torch.device("cuda"))
            for backend, (group, device) in groups.items():
                flag = torch.zeros(1, device=device)

                def all_reduce(flag: Any = flag, group: Any = group, device: Any = device) -> bool:
                    dist.all_reduce(flag, group=group)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    return False

                for _ in range(50):
                    all_reduce()
                dist.barrier()
                ar, _ = time_calls(all_reduce, args.allreduce_calls)
                out[f"allreduce_{backend}"] = _stats_us(ar)
            out["world_size"] = dist.get_world_size()
        finally:
            dist.destroy_process_group()
    Path(args.worker_out, f"rank{rank}.json").write_text(json.dumps(out))
    return 0


# --------------------------------------------------------------------------- driver


def micro(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The check inside hyperpodrun (with the all-reduce baseline) and outside any launcher."""
    script = str(Path(__file__).resolve())
    counts = ["--calls", str(CHECK_CALLS[args.mode]), "--allreduce-calls", str(ALLREDUCE_CALLS[args.mode])]
    inside, outside = work / "inside", work / "outside"
    for d in (inside, outside):
        d.mkdir(parents=True, exist_ok=True)
    launch = hyperpodrun_cmd(
        "--nnodes", "1:1", "--nproc-per-node", str(RANKS), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bench-overhead", "--log-dir", str(work / "logs"),
        script, "--worker-out", str(inside), *counts,
    )  # fmt: skip
    plain = [sys.executable, script, "--worker-out", str(outside), *counts]
    env = bench_env(OMP_NUM_THREADS="1")
    for name, cmd in (("hyperpodrun", launch), ("plain", plain)):
        done = run_to_completion(cmd, name=name, timeout=args.run_timeout, env=env, log_path=work / f"{name}.log")
        if done.returncode != 0:
            raise BenchmarkError(f"the {name} micro run exited {done.returncode}:\n{done.tail()}")
    ranks = [json.loads((inside / f"rank{r}.json").read_text()) for r in range(RANKS)]
    alone = json.loads((outside / "rank0.json").read_text())
    if not all(r["elastic"] for r in ranks) or alone["elastic"]:
        raise BenchmarkError("the control channel was not live under hyperpodrun, or was outside it")
    backends = [k.removeprefix("allreduce_") for k in ranks[0] if k.startswith("allreduce_")]
    return {
        "ranks_inside": ranks,
        "outside": alone,
        "check_inside_median_us": median(r["check"]["median_us"] for r in ranks),
        "check_inside_p99_us": max(r["check"]["p99_us"] for r in ranks),
        "check_outside_median_us": alone["check"]["median_us"],
        "check_outside_p99_us": alone["check"]["p99_us"],
        "timer_floor_median_us": alone["timer_floor"]["median_us"],
        "check_returned_true": sum(r["check_returned_true"] for r in ranks) + alone["check_returned_true"],
        **{f"allreduce_{b}_median_us": median(r[f"allreduce_{b}"]["median_us"] for r in ranks) for b in backends},
        **{f"allreduce_{b}_p99_us": max(r[f"allreduce_{b}"]["p99_us"] for r in ranks) for b in backends},
    }


def macro(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tokens/s of the example at the same size under both launchers, runs interleaved."""
    train = TrainArgs.from_namespace(args, steps=TRAIN_STEPS[args.mode])
    skip = WARMUP_STEPS[args.mode]
    env = bench_env(OMP_NUM_THREADS="1")
    runs: list[dict[str, Any]] = []
    for rep in range(TRAIN_REPS[args.mode]):
        order = ("hyperpodrun", "torchrun") if rep % 2 == 0 else ("torchrun", "hyperpodrun")
        for launcher in order:
            print(f"{NAME}: {launcher}, {RANKS} ranks, rep {rep + 1} ...", flush=True)
            run = run_training(
                launcher, RANKS, train, work=work / f"{launcher}-{rep}", data_cache=args.out / "data-cache",
                timeout=args.run_timeout, env=env,
            )  # fmt: skip
            tokens_per_s = wall_tokens_per_s(run["metrics"], train.tokens_per_step, skip=skip)
            runs.append({"rep": rep, "tokens_per_s": tokens_per_s, **run})
    tps = {name: [r["tokens_per_s"] for r in runs if r["launcher"] == name] for name in ("hyperpodrun", "torchrun")}
    paired = [ours / theirs for ours, theirs in zip(tps["hyperpodrun"], tps["torchrun"])]
    cpu = {name: median(r["launcher_cpu_fraction"] for r in runs if r["launcher"] == name) for name in tps}
    return {
        "train": train.as_params(),
        "warmup_steps": skip,
        "runs": runs,
        "hyperpodrun_tokens_per_s": median(tps["hyperpodrun"]),
        "torchrun_tokens_per_s": median(tps["torchrun"]),
        "throughput_ratio": median(tps["hyperpodrun"]) / median(tps["torchrun"]),
        "paired_ratios": paired,
        "hyperpodrun_agent_cpu_fraction": cpu["hyperpodrun"],
        "torchrun_agent_cpu_fraction": cpu["torchrun"],
    }


def plot(result: BenchmarkResult, m: dict[str, Any], t: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["check, outside\n(returns False)", "check, inside\nhyperpodrun"]
    med = [m["check_outside_median_us"], m["check_inside_median_us"]]
    p99 = [m["check_outside_p99_us"], m["check_inside_p99_us"]]
    for backend in ("gloo", "nccl"):
        if f"allreduce_{backend}_median_us" in m:
            labels.append(f"1-element all_reduce\n{backend}, {RANKS} ranks")
            med.append(m[f"allreduce_{backend}_median_us"])
            p99.append(m[f"allreduce_{backend}_p99_us"])
    xs = range(len(labels))
    ax1.bar([x - 0.2 for x in xs], med, 0.4, label="median")
    ax1.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax1.set_yscale("log")
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_ylabel("µs per call")
    ax1.set_title("per-step event check")
    ax1.legend()
    ax1.grid(True, axis="y", which="both", alpha=0.3)
    for name, marker in (("hyperpodrun", "o"), ("torchrun", "s")):
        reps = [r for r in t["runs"] if r["launcher"] == name]
        ax2.plot([r["rep"] + 1 for r in reps], [r["tokens_per_s"] for r in reps], marker, label=name, markersize=8)
    ax2.set_xlabel("repetition")
    ax2.set_ylabel("tokens/s (end to end)")
    ax2.set_title(f"example trainer, {RANKS} ranks: ratio {t['throughput_ratio']:.3f}")
    ax2.legend()
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"step_overhead ({result.mode}, {result.machine['usable_cpus']} CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run-timeout", type=float, default=600.0, help="hard limit per launched run, s")
        parser.add_argument("--client", choices=("loop", "hf"), default="loop",
                            help="loop: the hand-written example loop (default); hf: a Hugging Face Trainer job")  # fmt: skip
        add_train_arguments(parser)
        hf_client.add_worker_arguments(parser)
        # internal: the measuring worker
        parser.add_argument("--worker-out", help=argparse.SUPPRESS)
        parser.add_argument("--calls", type=int, default=CHECK_CALLS["quick"], help=argparse.SUPPRESS)
        parser.add_argument("--allreduce-calls", type=int, default=ALLREDUCE_CALLS["quick"], help=argparse.SUPPRESS)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    if args.worker_out:
        return worker_main(args)
    if args.hf_worker_out:
        return hf_client.worker_main(args)
    work = args.out / "work" / NAME
    shutil.rmtree(work, ignore_errors=True)
    if args.client == "hf":
        hf = hf_client.run(args, work / "hf", Path(__file__).resolve())
        path = hf.write(args.out)
        s = hf.summary
        print(format_table(
            ["launcher", "optimizer steps/s (median)"],
            [("hyperpodrun + ElasticCallback", s["hyperpodrun_callback_steps_per_s"]),
             ("torchrun, no callback", s["torchrun_steps_per_s"])],
        ))  # fmt: skip
        print(f"throughput ratio: {s['throughput_ratio']:.3f} (paired runs: {s['throughput_ratio_paired_min']:.3f} "
              f".. {s['throughput_ratio_paired_max']:.3f}; target >= 0.99)")  # fmt: skip
        print(f"wrote {path}")
        return 0
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        params={
            "ranks": RANKS,
            "check_calls": CHECK_CALLS[args.mode],
            "allreduce_calls": ALLREDUCE_CALLS[args.mode],
            "train_reps_per_launcher": TRAIN_REPS[args.mode],
            "omp_num_threads": 1,
            "hyperpodrun_mode": "elastic agent, --nnodes 1:1 --rdzv-backend c10d (embedded store)",
            "torchrun_mode": "--nnodes 1:1 --rdzv-backend c10d",
        },
        baseline="a one-element all_reduce per step on gloo with 2 ranks (HyperPod's design), timed in the same "
        "ranks; and the same training run under torchrun, interleaved",
    )
    m = micro(args, work / "micro")
    t = macro(args, work / "macro")
    result.samples = {"micro": m, "macro": t}
    result.summary = {
        "check_inside_median_us": m["check_inside_median_us"],
        "check_inside_p99_us": m["check_inside_p99_us"],
        "check_outside_median_us": m["check_outside_median_us"],
        "check_outside_p99_us": m["check_outside_p99_us"],
        "timer_floor_median_us": m["timer_floor_median_us"],
        **{k: v for k, v in m.items() if k.startswith("allreduce_")},
        "allreduce_gloo_over_check_inside": m["allreduce_gloo_median_us"] / m["check_inside_median_us"],
        "check_returned_true": m["check_returned_true"],
        "hyperpodrun_tokens_per_s": t["hyperpodrun_tokens_per_s"],
        "torchrun_tokens_per_s": t["torchrun_tokens_per_s"],
        "throughput_ratio": t["throughput_ratio"],
        "throughput_ratio_paired_min": min(t["paired_ratios"]),
        "throughput_ratio_paired_max": max(t["paired_ratios"]),
        "throughput_target": 0.99,
        "hyperpodrun_agent_cpu_fraction": t["hyperpodrun_agent_cpu_fraction"],
        "torchrun_agent_cpu_fraction": t["torchrun_agent_cpu_fraction"],
    }
    result.notes += [
        (
            "Per-call times include one perf_counter_ns pair (timer_floor_median_us); the check's own work "
            "is the difference."
        ),
        (
            "The throughput ratio compares whole runs on a shared machine: with few repetitions, run-to-run "
            "noise (other processes, CPU frequency) can exceed the launcher's effect; the per-run samples and "
            "the paired ratios (each hyperpodrun run over the torchrun run next to it) show the spread."
        ),
        (
            "agent_cpu_fraction is the launcher process's own CPU time (not its ranks') over the run's wall time: "
            "the share of one core its agent takes from the ranks on a node with no spare core."
        ),
    ]
    plot(result, m, t, result.plot_path(args.out))
    path = result.write(args.out)
    rows = [("elastic_event_detected(), outside", m["check_outside_median_us"], m["check_outside_p99_us"]),
            ("elastic_event_detected(), in hyperpodrun", m["check_inside_median_us"], m["check_inside_p99_us"])]  # fmt: skip
    for b in ("gloo", "nccl"):
        if f"allreduce_{b}_median_us" in m:
            rows.append(
                (
                    f"all_reduce(1 element), {b}, {RANKS} ranks",
                    m[f"allreduce_{b}_median_us"],
                    m[f"allreduce_{b}_p99_us"],
                )
            )
    print(format_table(["per-step call", "median µs", "p99 µs"], rows))
    print(format_table(
        ["launcher", "tokens/s (median)", "agent CPU (cores)"],
        [("hyperpodrun", t["hyperpodrun_tokens_per_s"], t["hyperpodrun_agent_cpu_fraction"]),
         ("torchrun", t["torchrun_tokens_per_s"], t["torchrun_agent_cpu_fraction"])],
    ))  # fmt: skip
    print(f"throughput ratio hyperpodrun/torchrun: {t['throughput_ratio']:.3f} "
          f"(paired runs: {min(t['paired_ratios']):.3f} .. {max(t['paired_ratios']):.3f}; target >= 0.99)")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
