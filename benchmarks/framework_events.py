"""Scale events of a Hugging Face Trainer job: downtime in place against the restart path, same run.

One launcher process per simulated node on this machine, ``--ranks-per-node`` ranks each (2 by
default), the Trainer job of ``hf_client.py`` (tiny GPT-2, byte tokens of the docs, global batch
8) written for in-place events (``elastic_init()``, ``ElasticTrainer``, ``ElasticCallback``):

    node A starts (it hosts the rendezvous store and is never stopped)
    join    node B starts                  1 node -> 2 (world 2 -> 4 with 2 ranks a node)
    leave   node B gets SIGTERM            2 nodes -> 1

Variants, interleaved (the order alternates from one repetition to the next):

* ``in-place``: ``--restart-mode auto`` (default): survivors keep their process, the
  joiner's rank is started parked and receives the state from a survivor in memory;
* ``restart``: the same script with ``--restart-mode process``: at the agreed step the
  Trainer saves ``checkpoint-<step>``, every rank exits and is restarted at the new size
  and resumes from the checkpoint: the baseline.

Before each event the ranks hold at a fixed step until their launcher has announced it
(the scenario needs no timing); the hold ends before the event's agreed step, so it is not
part of what is measured. Per event, from rank 0's step log: downtime = end of the first
step at the new size minus end of the last step before it (one step included); the
launchers' and ranks' phases from the event log. Steps run at their natural speed (no
padding).

    python benchmarks/framework_events.py [--quick | --smoke] [--ranks-per-node N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hf_client
from common import (
    BenchmarkError,
    BenchmarkResult,
    BenchmarkTimeoutError,
    ManagedProcess,
    OutputBus,
    bench_env,
    format_table,
    free_port,
    hyperpodrun_cmd,
    median,
    parse_args,
    pyplot,
    result_tag,
)
from scale_analysis import event_mode, hyperpodrun_phases, measure_event

NAME = "framework_events"
VARIANTS = ("in-place", "restart")
EVENTS = (("join", 2), ("leave", 1))  # kind, nodes after it


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The steps where the ranks wait for the next event to be announced, and the run's last step."""

    hold_join: int
    hold_leave: int
    max_steps: int

    def __post_init__(self) -> None:
        if not 0 < self.hold_join < self.hold_leave < self.max_steps:
            raise BenchmarkError(f"a schedule needs 0 < hold_join < hold_leave < max_steps: {self}")

    def arg(self) -> str:
        return f"{self.hold_join},{self.hold_leave},{self.max_steps}"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        join, leave, last = (int(x) for x in text.split(","))
        return cls(hold_join=join, hold_leave=leave, max_steps=last)


#: An event is agreed on for a step about 10 steps past its hold here; the smoke checks the script with a few steps
#: at each size after that, the measured modes give each world size 40 steps.
SCHEDULES = {
    "smoke": Schedule(hold_join=8, hold_leave=30, max_steps=46),
    "quick": Schedule(hold_join=20, hold_leave=60, max_steps=100),
    "full": Schedule(hold_join=20, hold_leave=60, max_steps=100),
}
REPS = {"smoke": 1, "quick": 2, "full": 4}
HOLD_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0
GLOBAL_BATCH, PER_DEVICE = hf_client.GLOBAL_BATCH, hf_client.PER_DEVICE
PHASES = (
    "scale_decided",
    "workers_signalled",
    "group_torn_down",
    "group_up",
    "hydrated",
    "checkpoint_saved",
    "workers_stopped",
    "workers_started",
    "checkpoint_loaded",
    "first_step",
)


# --------------------------------------------------------------------------- worker side


def worker_main(args: argparse.Namespace) -> int:
    """One rank of the Trainer job; rank 0 appends ``{ts, step, world_size, pid}`` per optimizer step to ``steps.jsonl``."""
    import os

    from transformers import TrainerCallback, TrainingArguments, set_seed

    from elastic_events import current_event
    from elastic_events.integrations.transformers import (
        ElasticCallback,
        ElasticTrainer,
        elastic_init,
        elastic_resume_checkpoint,
        set_global_batch,
    )

    out = Path(args.worker_out)
    schedule = Schedule.parse(args.schedule)
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    set_seed(0)
    model = hf_client.tiny_gpt2()  # built before elastic_init(): a parked joiner pays for it while it waits
    data = hf_client.doc_blocks()
    elastic_init()

    class StepLog(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if targs.process_index == 0:
                record = {
                    "ts": time.time(),
                    "step": state.global_step,
                    "world_size": targs.world_size,
                    "pid": os.getpid(),
                }
                with open(out / "steps.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
            # step -> nodes: there, wait for the next event's announcement
            holds = {schedule.hold_join: 1, schedule.hold_leave: 2}
            if holds.get(state.global_step) == targs.world_size // local_world:
                (out / f"held-{state.global_step}-{targs.process_index}").touch()
                deadline = time.monotonic() + HOLD_TIMEOUT_S
                while current_event() is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"no scale event announced within {HOLD_TIMEOUT_S:g}s of holding at step {state.global_step}"
                        )
                    time.sleep(0.02)

    training = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=PER_DEVICE,
        max_steps=schedule.max_steps,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    set_global_batch(training, GLOBAL_BATCH)
    trainer = ElasticTrainer(
        model=model,
        args=training,
        train_dataset=data,
        callbacks=[ElasticCallback(global_batch=GLOBAL_BATCH), StepLog()],
    )
    trainer.train(resume_from_checkpoint=elastic_resume_checkpoint(training.output_dir))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization: torch's gloo teardown can abort there (pytorch/pytorch#179291)


# --------------------------------------------------------------------------- driver side


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_file(path: Path, *, procs: list[ManagedProcess], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                raise BenchmarkError(f"{proc.name} exited {proc.poll()} while waiting for {what}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise BenchmarkTimeoutError(what, timeout)
        time.sleep(0.05)


def run_scenario(variant: str, work: Path, script: Path, *, ranks_per_node: int, schedule: Schedule) -> dict[str, Any]:
    """Node A, then B joins, then B leaves; the events measured from rank 0's step log and the event log."""
    work.mkdir(parents=True, exist_ok=True)
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"bench-fw-{free_port()}"
    flags = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        str(ranks_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        "lease_ttl=2,tick=0.1,propagation=0.05",
        "--scaling-timeout",
        "1",
        "--min-stable-period",
        "1",
        "--graceful-shutdown-timeout",
        "60",
        "--monitor-interval",
        "0.05",
        "--event-log",
        str(work / "events.jsonl"),
    ]
    if variant == "restart":
        flags += ["--restart-mode", "process"]
    env = bench_env(OMP_NUM_THREADS="1")
    bus = OutputBus()

    def node(name: str) -> ManagedProcess:
        cmd = hyperpodrun_cmd(
            *flags,
            "--log-dir",
            str(work / f"logs-{name}"),
            str(script),
            "--worker-out",
            str(work),
            "--schedule",
            schedule.arg(),
        )
        return ManagedProcess(cmd, name=f"{variant}-{name}", env=env, bus=bus, log_path=work / f"{name}.log")

    t_events: dict[str, float] = {}
    with node("A") as a:
        _wait_file(
            work / f"held-{schedule.hold_join}-0",
            procs=[a],
            timeout=RUN_TIMEOUT_S,
            what="node A's rank to hold before the join",
        )
        t_events["join"] = time.time()
        with node("B") as b:
            _wait_file(
                work / f"held-{schedule.hold_leave}-0",
                procs=[a, b],
                timeout=RUN_TIMEOUT_S,
                what="both nodes' ranks to hold before the leave",
            )
            t_events["leave"] = time.time()
            b.signal(signal.SIGTERM)
            codes = {"A": a.wait(RUN_TIMEOUT_S), "B": b.wait(RUN_TIMEOUT_S)}
        if codes != {"A": 0, "B": 0}:
            raise BenchmarkError(f"{variant}: launchers exited {codes}:\n{a.tail()}\n{b.tail()}")
    steps, events = _records(work / "steps.jsonl"), _records(work / "events.jsonl")
    measured = []
    for kind, to_nodes in EVENTS:
        to_world = to_nodes * ranks_per_node
        gap = measure_event(steps, t_event=t_events[kind], to_world=to_world)
        if gap is None:
            raise BenchmarkError(f"{variant}: no step at world size {to_world} after the {kind}")
        phases = hyperpodrun_phases(events, t_events[kind])
        measured.append(
            {
                "kind": kind,
                "to_world": to_world,
                **gap,
                "mode": event_mode(events, phases, t_events[kind]),
                "phases_s": {k: round(v, 4) for k, v in phases.items() if k in PHASES or k.endswith("_s")},
                "pid_kept": _pid_at(steps, gap["last_old_step"]) == _pid_at(steps, gap["first_new_step"]),
            }
        )
    return {"variant": variant, "events": measured}


def _pid_at(steps: list[dict[str, Any]], step: int) -> int | None:
    return next((r["pid"] for r in reversed(steps) if r["step"] == step), None)


def run(args: argparse.Namespace) -> BenchmarkResult:
    schedule = SCHEDULES[args.mode]
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "ranks_per_node": args.ranks_per_node,
            "nodes": "1 -> 2 -> 1",
            "global_batch": GLOBAL_BATCH,
            "per_device_batch": PER_DEVICE,
            "block": hf_client.BLOCK,
            "schedule": asdict(schedule),
            "reps": REPS[args.mode],
            "omp_num_threads": 1,
            "model": "GPT-2, 2 layers, 32 dims, byte vocabulary",
            "framework": "transformers.Trainer (ElasticTrainer)",
        },
        baseline="the same Trainer job and events with --restart-mode process (save checkpoint-<step>, restart every rank, "
        "resume from it), interleaved with the in-place runs",
    )
    work = args.out / "work" / NAME
    shutil.rmtree(work, ignore_errors=True)
    script = Path(__file__).resolve()
    runs = []
    for rep in range(REPS[args.mode]):
        for variant in VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS)):
            print(f"{NAME}: {variant}, rep {rep + 1} ...", flush=True)
            scenario = run_scenario(
                variant, work / f"{variant}-{rep}", script, ranks_per_node=args.ranks_per_node, schedule=schedule
            )
            runs.append({"rep": rep, **scenario})
    result.samples = {"runs": runs}
    summary: dict[str, Any] = {}
    for kind, _ in EVENTS:
        for variant in VARIANTS:
            events = [e for r in runs if r["variant"] == variant for e in r["events"] if e["kind"] == kind]
            summary[f"{kind}_{variant}_downtime_s"] = median(e["downtime_s"] for e in events)
            summary[f"{kind}_{variant}_modes"] = sorted({e["mode"] for e in events})
            summary[f"{kind}_{variant}_survivor_kept_process"] = all(e["pid_kept"] for e in events)
        summary[f"{kind}_downtime_ratio_in_place_over_restart"] = (
            summary[f"{kind}_in-place_downtime_s"] / summary[f"{kind}_restart_downtime_s"]
        )
    result.summary = summary
    result.notes.append(
        "2-core shared machine, gloo on loopback, tiny model: the restart path's cost here is mostly process start "
        "and imports (torch, transformers) and the checkpoint is small; on GPU nodes a restart adds CUDA/NCCL "
        "initialisation and the checkpoint's size, an in-place event the state transfer to newcomers."
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, variant in enumerate(VARIANTS):
        values = [summary[f"{kind}_{variant}_downtime_s"] for kind, _ in EVENTS]
        ax.bar([x + (i - 0.5) * width for x in range(len(EVENTS))], values, width, label=variant)
    ax.set_xticks(range(len(EVENTS)), [f"{kind} ({'1 -> 2' if to == 2 else '2 -> 1'} nodes)" for kind, to in EVENTS])
    ax.set_ylabel("downtime, s (median)")
    ax.set_title(f"HF Trainer: scale-event downtime, nodes of {args.ranks_per_node} ranks")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(result.plot_path(args.out), dpi=120)
    plt.close(fig)
    return result


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # internal: one rank of the job
        parser.add_argument("--schedule", help=argparse.SUPPRESS)  # internal: the worker's Schedule.arg()
        parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks of each simulated node [2]")

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    if args.worker_out:
        return worker_main(args)
    result = run(args)
    path = result.write(args.out)
    s = result.summary
    print(
        format_table(
            ["event", "in place, s", "restart path, s", "ratio"],
            [
                (
                    kind,
                    s[f"{kind}_in-place_downtime_s"],
                    s[f"{kind}_restart_downtime_s"],
                    s[f"{kind}_downtime_ratio_in_place_over_restart"],
                )
                for kind, _ in EVENTS
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
