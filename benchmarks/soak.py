"""Chaos soak: random joins, leaves, yields, failures and etcd outages against one training job.

The example trainer (tiny Llama, ``--min-step-time`` for a fixed step time, a checkpoint every
``--ckpt-every`` steps) on 3 simulated nodes (one ``hyperpodrun`` launcher with ``--ranks-per-node``
ranks each, 2 by default, all on this machine) under one etcd started here. ``--events`` random events at random steps
(seeded by ``--seed``), drawn so that every kind comes up before any repeats:

    join          a new launcher starts (up to 3)          leave      SIGTERM to a launcher
    yield         ``hyperpodctl yield 1``                   uncap      ``hyperpodctl uncap``
    kill_rank     kill -9 of one rank of a node             kill_node  kill -9 of a launcher's tree,
    stop_rank     SIGSTOP of one rank (``--hang-timeout``)             then a new launcher replaces it

A rank event hits one rank of a node at random; its siblings on that node are recorded, and
whether they were still the same processes once the job recovered (in place they must be).
    etcd_restart  kill -9 of etcd and a restart             etcd_pause etcd frozen (SIGSTOP) for 2-4 s

(A kind that exposes a bug can be left out in :data:`SKIPPED_KINDS`, with the reason; none is now.)

Each event waits for recovery (steps at the expected world size after a new round; after an
etcd event, steps after etcd is back) before the next. After every event the sample log is
checked for the steps trained since the event: graceful events must redo nothing and lose
nothing; failures may redo only the steps after the last committed checkpoint. A recovery
that does not come within the event timeout is a job death: the job is started again from
its checkpoint and the soak goes on.

Per path (the default in-place reconfiguration, and ``--restart-mode process``) the run trains
a fixed number of steps; goodput = time to reach them in a run of the same 3 nodes without
events / time with events. That run without events is also the fixed-size reference for the
final parameters (``--save-final``). The example runs with ``--deterministic-reduce``, so the final
parameters of a run with events must equal that reference bit for bit (``--all-reduce``: DDP's order).

    python benchmarks/soak.py [--quick | --smoke] [--seed N] [--events N] [--gap-steps LO,HI] [--paths in-process,process] [--all-reduce]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import soak_ledger as ledger
from common import (
    BenchmarkError,
    BenchmarkResult,
    BenchmarkTimeoutError,
    bench_env,
    format_table,
    median,
    parse_args,
    pyplot,
    require_train_script,
    result_tag,
    run_to_completion,
    start_etcd,
)
from soak_job import JobDied, SoakJob, SoakSettings

NAME = "soak"
PATHS = {"in-process": "auto", "process": "process"}
EVENTS = {"smoke": 5, "quick": 20, "full": 100}
DEFAULT_PATHS = {"smoke": ("in-process",), "quick": tuple(PATHS), "full": tuple(PATHS)}
#: Steps trained between the recovery from one event and the next event (uniform, inclusive).
GAP_STEPS = {"smoke": (2, 4), "quick": (6, 14), "full": (20, 40)}
SMOKE_KINDS = ("leave", "join", "kill_rank", "etcd_pause", "etcd_restart")
#: Kinds left out of every run, and why: each exposes a bug in src/ (benchmarks/README.md, Soak).
SKIPPED_KINDS: dict[str, str] = {}


# --------------------------------------------------------------------------- schedule (pure)


@dataclasses.dataclass(kw_only=True)
class JobState:
    """What the driver knows of the job: launchers alive, ranks training, whether a cap is set."""

    ranks_per_node: int = 1
    nodes: int = 3
    world: int = 3  # ranks: members x ranks_per_node
    capped: bool = False

    @classmethod
    def start(cls, ranks_per_node: int) -> JobState:
        return cls(ranks_per_node=ranks_per_node, nodes=3, world=3 * ranks_per_node)


def eligible(kind: str, state: JobState) -> bool:
    """Whether ``kind`` can be injected now without taking the job below 1 node or above 3."""
    if kind == "join":
        return state.nodes < 3 and not state.capped
    if kind in ("leave", "kill_node", "yield"):
        return state.world >= 2 * state.ranks_per_node and not state.capped
    if kind == "uncap":
        return state.capped
    return True


def expected_world(kind: str, state: JobState) -> int:
    """The world size training must reach after ``kind`` (kill_node: before its replacement joins)."""
    nodes = {"join": 1, "uncap": 1, "leave": -1, "yield": -1, "kill_node": -1}.get(kind, 0)
    return state.world + nodes * state.ranks_per_node


class Deck:
    """Event kinds in seeded random order, every kind once per pass; ineligible kinds wait their turn."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random) -> None:
        self.kinds, self.rng, self.pending = kinds, rng, []

    def draw(self, state: JobState) -> str:
        for _ in range(2):
            if not self.pending:
                self.pending = list(self.kinds)
                self.rng.shuffle(self.pending)
            for i, kind in enumerate(self.pending):
                if eligible(kind, state):
                    return self.pending.pop(i)
            self.pending = []
        raise ValueError(f"no event kind of {self.kinds} can be injected in {state}")


# --------------------------------------------------------------------------- one path


def run_path(
    path: str,
    settings: SoakSettings,
    *,
    events: int,
    seed: int,
    kinds: tuple[str, ...],
    gap: tuple[int, int],
    etcd: Any,
    work: Path,
    expected: Any,
) -> dict[str, Any]:
    """Train ``settings.steps`` steps with ``events`` random events (0: the reference run)."""
    # One stream each for the kinds, the gaps and the targets, so that both paths get the same
    # sequence of kinds and gaps even where a target draw (a node, a pause) differs between them.
    rng, gaps = random.Random(f"{seed}-targets"), random.Random(f"{seed}-gaps")
    deck, state = Deck(kinds, random.Random(f"{seed}-kinds")), JobState.start(settings.ranks_per_node)
    job = SoakJob(settings, restart_mode=PATHS[path], etcd=etcd, work=work)
    out: dict[str, Any] = {"path": path, "events": [], "job_deaths": [], "failure": None}
    try:
        job.start(3)
        job.wait_progress(world=None, after=job.t_start, timeout=settings.startup_timeout_s, what="the first steps")
        for index in range(events):
            at = job.last_step() + gaps.randint(*gap)
            if at >= settings.steps - settings.tail_steps:
                out["failure"] = f"training reached step {job.last_step()} of {settings.steps} before event {index + 1}"
                print(f"{NAME}: {path}: {out['failure']}", flush=True)
                break
            job.wait_step(at, timeout=settings.event_timeout_s)
            kind = deck.draw(state)
            ev = one_event(job, index, kind, state, rng, settings, expected)
            if ev["outcome"] == "finished":  # training reached its last step before it recovered: not a death
                out["failure"] = f"training ended during event {index + 1} ({kind}), at step {job.last_step()}"
                print(f"{NAME}: {path}: {out['failure']}", flush=True)
                break
            out["events"].append(ev)
            print(
                f"{NAME}: {path}: event {index + 1}/{events} {kind}: {ev['outcome']}, world {ev['to_world']}, "
                f"recovery {ev.get('recovery_s') or 0:.1f}s, redone {len(ev['check']['steps_redone'])}"
                + (f"; problems: {ev['check']['problems'][:2]}" if ev["check"]["problems"] else ""),
                flush=True,
            )
            if ev["outcome"] != "ok":
                out["job_deaths"].append({"event": index, "kind": kind, "error": ev["error"]})
                job.restart_after_death(state)
        if job.last_step() < settings.steps:  # (training may have ended during the last event: the launchers are gone)
            job.wait_step(settings.steps, timeout=settings.steps * settings.step_time_s * 4 + settings.event_timeout_s)
        out["time_to_steps_s"] = job.time_to_step(settings.steps)
    except (BenchmarkTimeoutError, JobDied) as e:
        out["failure"] = str(e)
        print(f"{NAME}: {path}: {e}", flush=True)
    finally:
        out["exit_codes"] = job.close()
    by_step = ledger.attempts_of(job.samples())
    # The check after each event saw only the steps up to its recovery; a failure's redone steps can
    # go on after that. Each event's final check covers its window up to the next event.
    starts = [ev["sample_line"] for ev in out["events"]] + [1 << 62]
    for ev, end in zip(out["events"], starts[1:]):
        committed = ev["check"]["committed_step"]
        ev["check"] = ledger.check_window(
            by_step,
            first_line=ev["sample_line"],
            end_line=end,
            committed=committed,
            graceful=ev["kind"] in ledger.GRACEFUL_KINDS,
            expected=expected,
        ).to_json()
    out["missing_steps"] = ledger.missing_steps(by_step, settings.steps)
    final = ledger.check_window(by_step, first_line=0, end_line=1 << 62, graceful=False, committed=0, expected=expected)
    out["final_check"] = final.to_json()
    out["steps_redone_total"] = sum(len(t) - 1 for t in by_step.values())
    out["timeline"] = [(r["ts"] - job.t_start, r["step"], r["world_size"]) for r in job.metrics()]
    out["final_params"] = str(job.final) if job.final.is_file() else None
    return out


def one_event(
    job: SoakJob, index: int, kind: str, state: JobState, rng: random.Random, settings: SoakSettings, expected: Any
) -> dict[str, Any]:
    """Inject one event, wait for recovery, check the sample log since the event."""
    line0, round0, world0 = job.sample_lines(), job.round(), state.world
    target = expected_world(kind, state)
    ev: dict[str, Any] = {
        "index": index,
        "kind": kind,
        "from_world": world0,
        "to_world": target,
        "at_step": job.last_step(),
    }
    t_event = time.time()
    try:
        detail = job.inject(kind, rng)
        ev["detail"] = detail
        t_end = time.time()
        new_round = kind not in ("etcd_restart", "etcd_pause")
        t_rec = job.wait_recovery(
            world=target,
            round_after=round0 if new_round else None,
            after=t_end,
            settle=settings.settle_steps,
            timeout=settings.event_timeout_s,
            what=kind,
        )
        ev["recovery_s"] = t_rec - t_event
        if kind == "kill_node":  # a new machine replaces the lost one
            target, round1 = world0, job.round()
            job.start(1)
            job.wait_recovery(
                world=target,
                round_after=round1,
                after=time.time(),
                settle=settings.settle_steps,
                timeout=settings.event_timeout_s,
                what="the replacement of a lost node",
            )
            ev["to_world"], ev["replaced_s"] = target, time.time() - t_event
        ev["outcome"] = "ok"
        ev["rounds"] = job.round() - round0
        if detail.get("siblings"):  # a rank event: are the node's other ranks the same processes?
            ev["siblings_kept"] = job.still_running(detail["siblings"])
    except (BenchmarkTimeoutError, JobDied) as e:
        finished = job.last_step() >= settings.steps
        ev.update(outcome="finished" if finished else "job_death", error=f"{e}\n{job.tails()}")
        target = state.world
    state.world, state.nodes = target, job.alive_count()
    state.capped = (state.capped or kind == "yield") and kind != "uncap"
    committed = ledger.committed_step(job.events(), t_event)
    check = ledger.check_window(
        ledger.attempts_of(job.samples()),
        first_line=line0,
        end_line=1 << 62,
        graceful=kind in ledger.GRACEFUL_KINDS,
        committed=committed,
        expected=expected,
    )
    ev["check"] = ev["live_check"] = check.to_json()  # the final check replaces "check" at the end of the run
    ev["sample_line"] = line0
    return ev


# --------------------------------------------------------------------------- summary


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def single_process_run(settings: SoakSettings, work: Path) -> Path:
    """The same steps in one plain process (world 1, no launcher): the float-order noise floor."""
    work.mkdir(parents=True, exist_ok=True)
    argv = settings.train_args(work)
    cut = argv.index("--min-step-time")
    argv = argv[:cut] + argv[cut + 2 :] + ["--min-step-time", "0"]
    done = run_to_completion(
        [sys.executable, str(require_train_script()), *argv],
        name="single-process",
        timeout=settings.steps * 2 + 120,
        env=bench_env(OMP_NUM_THREADS="1"),
        log_path=work / "output.log",
    )
    if done.returncode != 0:
        raise BenchmarkError(f"the single-process run exited {done.returncode}:\n{done.tail()}")
    return work / "final.pt"


def summarize(runs: dict[str, dict[str, Any]], reference: dict[str, Any], single: Path | None) -> dict[str, Any]:
    """Per path and event kind; ``single`` is the single-process run's final parameters (None: not run)."""
    import torch

    ref = torch.load(reference["final_params"]) if reference.get("final_params") else None
    one = torch.load(single) if single is not None else None
    summary: dict[str, Any] = {
        "paths": {},
        "reference_time_to_steps_s": reference.get("time_to_steps_s"),
        "noise_floor_max_abs_diff": max_abs_diff(ref, one) if ref is not None and one is not None else None,
    }
    for path, run in runs.items():
        by_kind: dict[str, Any] = {}
        for ev in run["events"]:
            k = by_kind.setdefault(
                ev["kind"],
                {
                    "n": 0,
                    "survived": 0,
                    "recovery_s": [],
                    "steps_redone": 0,
                    "samples_lost": 0,
                    "samples_repeated": 0,
                    "samples_redone": 0,
                    "redone_committed": 0,
                    "new_rounds": 0,
                    "problems": [],
                },
            )
            c = ev["check"]
            k["new_rounds"] += ev.get("rounds") or 0
            k["n"] += 1
            k["survived"] += ev["outcome"] == "ok"
            if ev.get("recovery_s") is not None:
                k["recovery_s"].append(ev["recovery_s"])
            k["steps_redone"] += len(c["steps_redone"])
            k["redone_committed"] += len(c["redone_committed"])
            for key in ("samples_lost", "samples_repeated", "samples_redone"):
                k[key] += c[key]
            k["problems"] += c["problems"]
        for k in by_kind.values():
            rec = k.pop("recovery_s")
            k["recovery_median_s"] = median(rec) if rec else None
            k["recovery_max_s"] = max(rec) if rec else None
        graceful = [k for kind, k in by_kind.items() if kind in ledger.GRACEFUL_KINDS]
        s: dict[str, Any] = {
            "events_total": len(run["events"]),
            "events_survived": sum(ev["outcome"] == "ok" for ev in run["events"]),
            "job_deaths": len(run["job_deaths"]),
            "failure": run["failure"],
            "graceful_samples_lost": sum(k["samples_lost"] for k in graceful),
            "graceful_samples_repeated": sum(k["samples_repeated"] + k["samples_redone"] for k in graceful),
            "graceful_steps_redone": sum(k["steps_redone"] for k in graceful),
            "committed_steps_redone": sum(k["redone_committed"] for k in by_kind.values()),
            "steps_redone": sum(k["steps_redone"] for k in by_kind.values()),
            "missing_steps": len(run["missing_steps"]),
            # A failure may leave a step without the failed rank's record: killed or stopped after the
            # all-reduce (the step trained, the ledger's "unlogged"; in place the job goes on from it)
            # or, on the restart path, before a redo whose records interleave with its own.
            "steps_unlogged_at_failures": sum(
                len(ev["check"]["steps_unlogged"]) for ev in run["events"] if ev["kind"] in ledger.FAILURE_KINDS
            ),
            "missing_steps_outside_failures": len(
                set(run["missing_steps"])
                - {
                    step
                    for ev in run["events"]
                    if ev["kind"] in ledger.FAILURE_KINDS
                    for step in (*ev["check"]["steps_redone"], *ev["check"]["steps_unlogged"])
                }
            ),
            # rank events on a node of several ranks: in how many its other ranks went on as the same processes
            "siblings_kept": [
                sum(bool(ev["siblings_kept"]) for ev in run["events"] if "siblings_kept" in ev),
                sum("siblings_kept" in ev for ev in run["events"]),
            ],
            "final_samples_lost": run["final_check"]["samples_lost"],
            "final_samples_repeated": run["final_check"]["samples_repeated"],
            "launcher_exit_codes": run["exit_codes"],
            "by_kind": by_kind,
            "time_to_steps_s": run.get("time_to_steps_s"),
            "goodput": None,
            "final_max_abs_diff": None,
        }
        if s["time_to_steps_s"] and summary["reference_time_to_steps_s"]:
            s["goodput"] = ledger.goodput(summary["reference_time_to_steps_s"], s["time_to_steps_s"])
        if ref is not None and run.get("final_params"):
            final = torch.load(run["final_params"])
            s["final_max_abs_diff"] = max_abs_diff(final, ref)
            s["final_within_1e-4"] = s["final_max_abs_diff"] <= 1e-4
            s["final_vs_single_process_max_abs_diff"] = max_abs_diff(final, one) if one is not None else None
        summary["paths"][path] = s
    return summary


def plot(result: BenchmarkResult, runs: dict[str, Any], reference: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, (name, run) in enumerate([("no events", reference), *runs.items()]):
        tl = run.get("timeline") or []
        ax1.plot([t for t, _, _ in tl], [s for _, s, _ in tl], ".", markersize=2, color=f"C{i}", label=name)
    ax1.set_xlabel("seconds since the launchers started")
    ax1.set_ylabel("step (rank 0)")
    ax1.set_title("progress (steps going back = redone after a failure)", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    summary = result.summary["paths"]
    kinds = [k for k in ledger.KINDS if any(k in s["by_kind"] for s in summary.values())]
    width = 0.8 / max(1, len(summary))
    for j, (name, s) in enumerate(summary.items()):
        xs = [x + (j - (len(summary) - 1) / 2) * width for x in range(len(kinds))]
        ys = [(s["by_kind"].get(k) or {}).get("recovery_median_s") or 0 for k in kinds]
        ax2.bar(xs, ys, width, label=f"{name} (goodput {s['goodput'] or 0:.2f})", color=f"C{j + 1}")
    ax2.set_xticks(range(len(kinds)), kinds, rotation=40, ha="right", fontsize=8)
    ax2.set_ylabel("event to recovery, s (median)")
    ax2.legend(fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"soak ({result.mode}, seed {result.params['seed']}, {result.params['events']} events, "
        f"step time {result.params['step_time_s']} s, checkpoint every {result.params['ckpt_every']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gap_steps(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--gap-steps: expected LO,HI (two whole numbers of steps), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"--gap-steps: expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--seed", type=int, default=0, help="seeds the events, their steps and targets [0]")
        parser.add_argument("--events", type=int, default=None, help="events per path (smoke 5, quick 20, full 100)")
        parser.add_argument("--paths", default=None, help=f"from {', '.join(PATHS)} (smoke: in-process only)")
        parser.add_argument("--kinds", default=None, help=f"event kinds to draw from [{','.join(ledger.KINDS)}]")
        parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks of each simulated node [2]")
        parser.add_argument("--step-time", type=float, default=0.3, help="fixed step time, s [0.3]")
        parser.add_argument("--ckpt-every", type=int, default=5, help="periodic checkpoint interval, steps [5]")
        parser.add_argument("--dtype", choices=("fp64", "fp32"), default="fp32", help="the example's --dtype [fp32]")
        parser.add_argument(
            "--model",
            default=None,
            help="the example's model preset [tiny; smoke: micro, whose state moves between the ranks every step "
            "in a tenth of the time]",
        )
        parser.add_argument(
            "--all-reduce",
            action="store_true",
            help="the example's DDP all-reduce instead of --deterministic-reduce: final parameters then "
            "drift from the reference by the float order of each world size (fp64 starts it at 1e-16)",
        )
        parser.add_argument(
            "--gap-steps",
            default=None,
            metavar="LO,HI",
            help="steps between an event's recovery and the next event (smoke 2,4; quick 6,14; full 20,40)",
        )
        parser.add_argument(
            "--include-skipped",
            action="store_true",
            help=f"draw the kinds left out for known bugs too ({', '.join(SKIPPED_KINDS)})",
        )
        parser.add_argument(
            "--no-noise-floor",
            action="store_true",
            help="skip the single-process run of the same steps (the float-order noise floor; "
            "about as long as the reference)",
        )

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    events = args.events if args.events is not None else EVENTS[args.mode]
    paths = tuple(args.paths.split(",")) if args.paths else DEFAULT_PATHS[args.mode]
    kinds = tuple(args.kinds.split(",")) if args.kinds else SMOKE_KINDS if args.mode == "smoke" else ledger.KINDS
    for p in paths:
        if p not in PATHS:
            raise SystemExit(f"--paths: unknown path {p!r}; choose from {', '.join(PATHS)}")
    for k in kinds:
        if k not in ledger.KINDS:
            raise SystemExit(f"--kinds: unknown kind {k!r}; choose from {', '.join(ledger.KINDS)}")
    skipped = {} if args.include_skipped else SKIPPED_KINDS
    kinds = tuple(k for k in kinds if k not in skipped)
    gap = GAP_STEPS[args.mode] if args.gap_steps is None else _gap_steps(args.gap_steps)
    # Steps for the startup, every event (its gap, the steps trained until the agreed step or the
    # detection, the settle steps at the new size: ~9 in the quick run) and a short tail; an event
    # that would fall into the tail is not injected (the run says so).
    steps = 8 + events * (sum(gap) // 2 + 9) + 10
    settings = SoakSettings(
        steps=steps,
        ranks_per_node=args.ranks_per_node,
        global_batch=6 * args.ranks_per_node,
        step_time_s=args.step_time,
        ckpt_every=args.ckpt_every,
        model=args.model or ("micro" if args.mode == "smoke" else "tiny"),
        dtype=args.dtype,
        deterministic_reduce=not args.all_reduce,
        data_cache=args.out / "data-cache",
    )
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "seed": args.seed,
            "events": events,
            "paths": list(paths),
            "kinds": list(kinds),
            "skipped_kinds": skipped,
            "gap_steps": list(gap),
            "step_time_s": args.step_time,
            "ckpt_every": args.ckpt_every,
            "noise_floor": not args.no_noise_floor,
            "settings": settings.as_params(),
        },
        baseline=f"the same 3 nodes of {args.ranks_per_node} ranks training the same steps without events, in the same run (time to the step "
        "target, and the final parameters as the fixed-size reference)",
    )
    work_root = args.out / "work" / NAME
    shutil.rmtree(work_root, ignore_errors=True)
    expected = settings.expected_batches()
    etcd = start_etcd()
    try:
        print(f"{NAME}: reference run, {steps} steps without events", flush=True)
        reference = run_path(
            "in-process",
            settings,
            events=0,
            seed=args.seed,
            kinds=kinds,
            gap=gap,
            etcd=etcd,
            work=work_root / "reference",
            expected=expected,
        )
        runs = {}
        for path in paths:
            print(f"{NAME}: {path}: {events} events over {steps} steps", flush=True)
            runs[path] = run_path(
                path,
                settings,
                events=events,
                seed=args.seed,
                kinds=kinds,
                gap=gap,
                etcd=etcd,
                work=work_root / path,
                expected=expected,
            )
    finally:
        etcd.stop()
    single = None
    if not args.no_noise_floor:
        print(f"{NAME}: the same {steps} steps in a single process (world 1)", flush=True)
        single = single_process_run(settings, work_root / "single-process")
    result.samples = {"reference": reference, "runs": runs}
    result.summary = summarize(runs, reference, single)
    result.notes += [
        "All nodes, their ranks and etcd share this machine's CPUs: a restart (Python + torch import, DCP load) "
        "is slower here than on a node of its own, and recovery times move with the machine's load.",
        "Final parameters: the example sums each step's per-sample gradients in an order fixed by their batch "
        "positions (--deterministic-reduce), so every world size trains the same bits: any difference from the "
        "reference is an event's doing. With --all-reduce, runs at different world sizes sum in another order and "
        "over hundreds of AdamW steps those last-bit differences grow (~10x every 10 steps on this model, to ~0.5). "
        "noise_floor_max_abs_diff (the reference on 3 nodes against one process, neither with events) is what "
        "the summation order alone produces for the same steps: 0 with the deterministic reduction.",
        f"Event kinds left out: {skipped or 'none'}.",
    ]
    plot(result, runs, reference, result.plot_path(args.out))
    out_path = result.write(args.out)
    rows = []
    for path, s in result.summary["paths"].items():
        for kind, k in s["by_kind"].items():
            rows.append(
                (
                    path,
                    kind,
                    f"{k['survived']}/{k['n']}",
                    k["recovery_median_s"],
                    k["steps_redone"],
                    k["samples_lost"],
                    k["samples_repeated"] + (k["samples_redone"] if kind in ledger.GRACEFUL_KINDS else 0),
                    k["new_rounds"],
                    len(k["problems"]),
                )
            )
    print(
        format_table(
            ["path", "event", "survived", "recovery s", "steps redone", "lost", "repeated", "rounds", "problems"], rows
        )
    )
    for path, s in result.summary["paths"].items():
        print(
            f"{path}: {s['events_survived']}/{s['events_total']} events survived, {s['job_deaths']} job deaths, "
            f"siblings of a failed rank kept in {s['siblings_kept'][0]}/{s['siblings_kept'][1]}, "
            f"goodput {s['goodput'] if s['goodput'] is None else round(s['goodput'], 3)}, "
            f"final parameters vs reference max |diff| {s['final_max_abs_diff']}, vs one process "
            f"{s.get('final_vs_single_process_max_abs_diff')}"
        )
    print(
        f"noise floor (reference on 3 nodes vs one process, no events): max |diff| "
        f"{result.summary['noise_floor_max_abs_diff']}"
    )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
