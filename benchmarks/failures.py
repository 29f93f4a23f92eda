"""Failure recovery: downtime, steps redone and phases of a rank crash, a hang and a node loss, hyperpodrun in place / restarting against torchrun.

The same training script as ``scale_events.py`` (the example trainer: tiny Llama,
``ElasticTraining``, ``--min-step-time`` for a fixed step time, a periodic checkpoint every
``--ckpt-every`` steps) on 2 simulated nodes of 2 ranks (``--smoke``: 1; one launcher per node on this
machine; B starts once A hosts the store), under each launcher variant in the same run:

* ``hyperpodrun`` (``--restart-mode auto``): every rank uses ``ElasticTraining``, so the round
  runs in process and a failure is repaired in place: the survivors catch the failed collective
  (``elastic.recover``) and join the repaired group; a crashed or hung rank's node restarts only
  that rank, parked, and it is hydrated from the survivors' memory: no checkpoint is read;
* ``hyperpodrun-restart`` (``--restart-mode process``): every rank restarts and resumes from the
  last DCP checkpoint;
* ``torchrun --nnodes 1:2 --rdzv-backend c10d --max-restarts N`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``torchrun-noshare``; ``torchrun``: as shipped):
  restarts every worker, which resumes from the last checkpoint.

Failures (``--kinds``, drawn in turn), always of node B's rank or node (the node without global
rank 0), at seeded random steps (the same steps for every variant, spread over the checkpoint
interval), each once the job has recovered from the previous one and trained a few steps. In place, a
crash or a hang is injected only once the victim node's spare rank is ready (up to 60 s; each event records
``spare_ready`` and the seconds waited), as a job whose failures come hours apart finds it: on 2 cores a
spare takes seconds to import torch, and a failure before that measures a spare still starting. The other
variants keep no spare, so hyperpodrun's failures can come a few steps later than the plan (``late_by_steps``):

    rank_crash  kill -9 of the rank
    hang        SIGSTOP of the rank (hyperpodrun ``--hang-timeout 5``; torchrun has no hang
                detection: skipped for it)
    node_loss   kill -9 of the launcher's whole process tree; the job goes on at 1 node, then a
                new node B starts and joins (``rejoin``, measured too)

Per failure, from rank 0's per-step log (``--metrics``): downtime = end of the last step logged
before the failure to the end of the first step logged after the recovery (one step included);
steps lost = that last step minus the step training resumed from (work redone); lost time =
downtime + steps lost x step time; time to detect = failure until the launcher noticed
(hyperpodrun: its ``worker_failed`` / ``rank_hung`` / ``node_lost`` / ``scale_decided`` record;
torchrun: its agent's "will restart worker group" line); hyperpodrun's phases (seconds from the
failure) from its event log. The timers and launcher flags are ``scale_events.Timers``; the
analysis reuses ``scale_analysis`` (medians and ratios per kind and variant).

    python benchmarks/failures.py [--quick | --smoke] [--seed N] [--kinds rank_crash,hang,node_loss]
        [--launchers hyperpodrun,hyperpodrun-restart,torchrun-noshare,torchrun]
    python benchmarks/failures.py --quick --launchers hyperpodrun,torchrun-noshare --kinds rank_crash,node_loss \
        --layouts ddp,fsdp,hsdp   # layouts in one run; nodes of 2 ranks as in scale_events.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from common import (
    BenchmarkResult,
    BenchmarkTimeoutError,
    TrainArgs,
    format_table,
    parse_args,
    read_metrics,
    require_train_script,
    result_tag,
)
from failure_analysis import (
    RESUMED_RECORDS,
    failure_plan,
    measure_failure,
    phase_medians,
    rejoin_summary,
    repair_mode,
    target_report,
)
from layouts import LAYOUT_FLAGS, plot_layouts, run_label, summarize_by_layout
from scale_analysis import (
    OURS,
    bytes_moved,
    event_mode,
    hyperpodrun_phases,
    lost_time,
    measure_event,
    moved_by_kind,
    phase_breakdown,
    plot,
    summarize_events,
)
from scale_events import (
    STARTUP_TIMEOUT_S,
    Scenario,
    ScenarioFailed,
    Timers,
    add_scenario_arguments,
    chosen_launchers,
    chosen_layouts,
    resolve_node_shape,
    run_variants,
)

NAME = "failures"
KINDS = ("rank_crash", "hang", "node_loss")  # drawn in turn; a node loss is followed by a new node joining
#: What each kind does to the non-master node: its rank, or its launcher's whole process tree.
KIND_ACTION = {
    "rank_crash": "kill -9 of its rank",
    "node_loss": "kill -9 of its launcher's tree",
    "hang": "SIGSTOP of its rank",
}
#: Failures an in-place job repairs with the node's spare rank (a lost node takes its spare with it), the
#: agent records that start or use one, and how long to wait for it before injecting such a failure.
SPARE_KINDS = ("rank_crash", "hang")
SPARE_RECORDS = ("workers_started", "ranks_replaced", "spare_ready")
SPARE_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class SpareWait:
    """What the wait for the victim node's spare found before a failure: whether it was ready and the seconds
    waited (both None: not looked for, no spare in this variant or for this kind)."""

    ready: bool | None = None
    waited_s: float | None = None


#: torchrun has no hang detection: a stopped rank blocks its peers until the collective timeout.
NOT_DETECTED = {"torchrun": ("hang",), "torchrun-noshare": ("hang",)}
HANG_TIMEOUT_S = 5.0
GROUP_RANK = re.compile(r"this node is group rank (\d+)")
DEFAULT_VARIANTS = {
    "smoke": ("hyperpodrun",),
    "quick": ("hyperpodrun", "hyperpodrun-restart", "torchrun-noshare"),
    "full": ("hyperpodrun", "hyperpodrun-restart", "torchrun-noshare"),
}
EVENTS_PER_KIND = {"smoke": 1, "quick": 4, "full": 10}
EVENT_TIMEOUT_S = {"smoke": 60.0, "quick": 90.0, "full": 120.0}
SETTLE_STEPS = {"smoke": 2, "quick": 3, "full": 4}
#: Records of hyperpodrun's event log that mark the launcher noticing a failure.
DETECT_RECORDS = ("worker_failed", "rank_hung", "node_lost", "scale_decided")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureTimers(Timers):
    """``scale_events.Timers`` plus hyperpodrun's ``--hang-timeout`` (the launcher's floor is 60 s)."""

    hang_timeout_s: float = HANG_TIMEOUT_S

    def launcher_args(self, variant: str, endpoint: str, run_id: str, work: Path, node: str) -> list[str]:
        args = super().launcher_args(variant, endpoint, run_id, work, node)
        return args + ["--hang-timeout", f"{self.hang_timeout_s:g}"] if variant in OURS else args


# --------------------------------------------------------------------------- one launcher's run


class FailureScenario(Scenario):
    """Two nodes of one launcher variant (B started once A hosts the store); at given steps the one
    that does not hold rank 0 fails (its rank killed or stopped, or the whole node killed)."""

    #: After a node loss a new node with the lost one's name starts and joins (measured as its ``rejoin``).
    rejoin_after_loss = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost: set[str] = set()  # nodes that left on purpose (node loss, a graceful leave), not a job death

    @property
    def full_world(self) -> int:
        """The world size of the job's two nodes."""
        return 2 * self.timers.nproc_per_node

    def event_log(self) -> list[dict[str, Any]]:
        """hyperpodrun's event log (every node's agent and rank append to the same file)."""
        return read_metrics(self.work / "events.jsonl")  # the same tolerant JSON-lines reader

    def _check_job(self) -> None:
        for name, node in self.nodes.items():
            if node.poll() is not None and name not in self.lost:
                raise ScenarioFailed("exited", f"node {name} exited with {node.poll()}:\n{node.tail(15)}")

    def rank_pids(self, name: str) -> dict[int, int]:
        """``RANK`` it was started with (-1: none, a parked rank) -> pid of the ranks under node ``name``'s launcher."""
        script = str(require_train_script())
        try:
            procs = psutil.Process(self.nodes[name].pid).children(recursive=True)
            ranks = [p for p in procs if script in p.cmdline()]
        except psutil.NoSuchProcess:
            return {}
        pids = {p.pid for p in ranks}
        out = {}
        for proc in ranks:
            try:
                if proc.ppid() not in pids:  # a rank, not one of its own children
                    out[int(proc.environ().get("RANK", "-1"))] = proc.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
                continue
        return out

    def wait_step(self, step: int, *, world: int, what: str) -> None:
        """Until rank 0's latest logged step is at least ``step`` at ``world``."""

        def ready(_: object) -> bool:
            self._check_job()
            recs = self.records()
            return bool(recs) and recs[-1]["step"] >= step and recs[-1]["world_size"] == world

        self.bus.wait_for(ready, timeout=self.event_timeout, what=what)

    def run_failures(self, plan: list[tuple[str, int]]) -> dict[str, Any]:
        return self.drive(self._failures(plan))

    def start_two_nodes(self, *, steps: int) -> int:
        """Start A, then B once A hosts the store (agents started together race to host it); returns the
        world size once rank 0 has logged ``steps`` steps at it."""
        self.start_node("A")
        self.bus.wait_for(
            lambda _: self._check_job() or listening(self.endpoint),
            timeout=STARTUP_TIMEOUT_S,
            what=f"{self.variant}: node A's store at {self.endpoint}",
        )
        self.start_node("B")
        full = self.full_world
        self.wait_steps_at(full, steps, timeout=STARTUP_TIMEOUT_S, what=f"{self.variant}: steps at world {full}")
        return full

    def _failures(self, plan: list[tuple[str, int]]) -> Iterator[Callable[[int], dict[str, Any]]]:
        full = self.start_two_nodes(steps=self.settle_steps)
        for kind, step in plan:
            if kind in NOT_DETECTED.get(self.variant, ()):
                continue
            spare = self._await_spare(kind)
            self.wait_step(step, world=full, what=f"{self.variant}: step {step} at world {full}")
            yield functools.partial(self._failure, kind=kind, step=step, spare=spare)

    def _await_spare(self, kind: str) -> SpareWait:
        """In place, a crashed or hung rank is replaced by its node's spare rank: before such a failure, wait (up
        to :data:`SPARE_WAIT_S`) until the victim's node reports its spare ready, as a job whose failures come
        hours apart would find it."""
        if self.variant != "hyperpodrun" or kind not in SPARE_KINDS:
            return SpareWait()
        node, _ = self._victim()
        t0 = time.monotonic()
        try:
            self.bus.wait_for(
                lambda _: self._check_job() or self._spare_ready(node),
                timeout=SPARE_WAIT_S,
                what=f"{self.variant}: node {node}'s spare rank",
            )
            ready = True
        except BenchmarkTimeoutError:
            ready = False  # the failure then measures a repair whose replacement is still starting
        return SpareWait(ready=ready, waited_s=time.monotonic() - t0)

    def _spare_ready(self, name: str) -> bool:
        """Whether node ``name``'s agent reported its spare ready after it last started or replaced ranks."""
        ready = False
        for record in self._node_records(name):
            if record["event"] in SPARE_RECORDS:
                ready = record["event"] == "spare_ready"
        return ready

    def _node_records(self, name: str) -> Iterator[dict[str, Any]]:
        """hyperpodrun's event-log records from node ``name``'s current launcher (its node id ends in its pid)."""
        suffix = f"-{self.nodes[name].pid}"
        return (record for record in self.event_log() if str(record["node"]).endswith(suffix))

    def _resumed_after(self, t_event: float) -> float | None:
        """When hyperpodrun's log says the job runs again after the failure at ``t_event`` (None: not yet)."""
        if self.variant not in OURS:
            return None
        phases = hyperpodrun_phases(self.event_log(), t_event)
        done = [phases[r] for r in RESUMED_RECORDS if r in phases]
        return t_event + min(done) if done else None

    def _rejoin(self, node: str) -> dict[str, Any]:
        """Start a new ``node`` after its loss and measure the job's way back to 2 nodes (a join)."""
        self.lost.discard(node)
        t_start = self.start_node(node)
        full = self.full_world
        try:
            self.wait_steps_at(
                full,
                self.settle_steps,
                timeout=self.event_timeout,
                what=f"{self.variant}: steps at world {full} after node {node} started again",
            )
        except BenchmarkTimeoutError as e:
            return {"outcome": "hang", "error": f"{e}; last output:\n{self._tails()}"}
        except ScenarioFailed as e:
            return {"outcome": e.outcome, "error": str(e)}
        measured = measure_event(self.records(), t_event=t_start, to_world=full) or {}
        mode = "restart"
        if self.variant in OURS:
            log = self.event_log()
            mode = event_mode(log, hyperpodrun_phases(log, t_start), t_start)
        return {
            "outcome": "ok",
            "t_start": t_start,
            "mode": mode,
            **{k: measured.get(k) for k in ("downtime_s", "steps_lost")},
        }

    def master_node(self) -> str | None:
        """The node whose launcher holds group rank 0 now (and so global rank 0).

        hyperpodrun says so on every round ("this node is group rank N"); a rank moved in place
        keeps the ``RANK`` it was started with, so only torchrun's (always restarted) ranks are read.
        """
        if self.variant in OURS:
            for line in reversed(self.bus.lines()):
                found = GROUP_RANK.search(line.text)
                if found and found.group(1) == "0" and line.source in self.nodes:
                    return line.source
            return None
        return next((name for name in self.nodes if 0 in self.rank_pids(name)), None)

    def node_rank_pids(self, name: str) -> list[int]:
        """hyperpodrun: the pids of node ``name``'s training ranks, by local rank, as its agent last started
        them (a failed rank's replacement in its place; the spare rank, which runs the same script and
        waits, is not one of them)."""
        latest: dict[int, int] = {}
        nproc = self.timers.nproc_per_node
        for record in self._node_records(name):
            if record["event"] == "workers_started":  # {local rank: pid} (JSON keys are strings)
                latest = {int(local): pid for local, pid in record["pids"].items()}
            elif record["event"] == "ranks_replaced":  # global ranks, contiguous per node, and their new pids
                latest.update({rank % nproc: pid for rank, pid in zip(record["ranks"], record["pids"])})
        return [latest[local] for local in sorted(latest)]

    def active_rank_pid(self, name: str) -> int | None:
        """The pid of the rank of node ``name`` that a failure hits: its last local rank (on a node of several
        ranks its siblings survive), for hyperpodrun from its agent's records, for torchrun from ``RANK``."""
        if self.variant not in OURS:
            pids = {r: pid for r, pid in self.rank_pids(name).items() if r >= 0}
            return pids[max(pids)] if len(pids) == self.timers.nproc_per_node else None
        ranks = self.node_rank_pids(name)
        return ranks[-1] if ranks and psutil.pid_exists(ranks[-1]) else None

    def _victim(self) -> tuple[str, int]:
        """(node, pid) of the last rank of the node that does not hold global rank 0 (the last global rank)."""
        master = self.master_node()
        for name in sorted(set(self.nodes) - {master}):
            pid = self.active_rank_pid(name) if master is not None else None
            if pid is not None:
                return name, pid
        raise ScenarioFailed(
            "hang",
            f"no rank of a node without rank 0 (node {master}) found: "
            f"{ {name: self.rank_pids(name) for name in self.nodes} }",
        )

    def _failure(self, index: int, *, kind: str, step: int, spare: SpareWait = SpareWait()) -> dict[str, Any]:
        """Inject ``kind`` at ``step`` and measure the job's way back; ``spare``: what :meth:`_await_spare`
        found before it."""
        node, pid = self._victim()
        full = self.full_world
        world = full - self.timers.nproc_per_node if kind == "node_loss" else full
        print(
            f"{NAME}: {self.variant}: event {index + 1} {kind} at step {step}: {KIND_ACTION[kind]} "
            f"(node {node}, rank {full - 1}, pid {pid})",
            flush=True,
        )
        t_event = time.time()
        if kind == "node_loss":
            self.lost.add(node)
            self.nodes[node].kill_tree()
        else:
            os.kill(pid, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
        ev: dict[str, Any] = {
            "index": index,
            "kind": kind,
            "node": node,
            "rank": full - 1,
            "pid": pid,
            "at_step": step,
            "t_event": t_event,
            "from_world": full,
            "to_world": world,
            "spare_ready": spare.ready,
            "spare_waited_s": spare.waited_s,
        }
        grace = self.timers.step_time_s

        def recovered(_: object) -> dict[str, Any] | None:
            self._check_job()
            resumed = self._resumed_after(t_event)
            if self.variant in OURS and resumed is None:
                return None
            m = measure_failure(self.records(), t_event=t_event, grace=grace, resumed_after=resumed)
            if m is None:
                return None
            after = [r for r in self.records() if r["ts"] >= m["first_new_ts"] and r["world_size"] == world]
            return m if len(after) >= self.settle_steps else None

        try:
            measured = self.bus.wait_for(
                recovered,
                timeout=self.event_timeout,
                what=f"{self.variant}: {self.settle_steps} steps after the {kind} at step {step}",
            )
        except BenchmarkTimeoutError as e:
            return {**ev, "outcome": "hang", "error": f"{e}; last output:\n{self._tails()}"}
        except ScenarioFailed as e:
            return {**ev, "outcome": e.outcome, "error": str(e)}
        ev.update(outcome="ok", **measured, late_by_steps=measured["last_old_step"] - step)
        ev["lost_time_s"] = lost_time(ev["downtime_s"], ev["steps_lost"], self.timers.step_time_s)
        if kind == "node_loss" and self.rejoin_after_loss:  # a new node B: the next failure finds 2 nodes again
            rejoin = self._rejoin(node)
            ev["rejoin"] = rejoin
            if rejoin["outcome"] != "ok":
                return {**ev, "outcome": rejoin["outcome"], "error": rejoin["error"]}
        if self.variant in OURS:
            log = self.event_log()
            ev["phases_s"] = hyperpodrun_phases(log, t_event)
            ev["bytes_moved"] = bytes_moved(log, t_event)
            ev["mode"] = repair_mode(ev["phases_s"])
            noticed = [ev["phases_s"][r] for r in DETECT_RECORDS if r in ev["phases_s"]]
            ev["detect_s"] = min(noticed) if noticed else None
            if hung := [r for r in log if r["event"] == "rank_hung" and r["ts"] > t_event]:
                ev["hang_idle_s"] = hung[0]["idle_s"]  # from the rank's last step, which precedes the SIGSTOP
        else:
            ev["mode"] = "restart"
            ev["detect_s"] = self.detect_time(t_event, measured["first_new_ts"])
        return ev


def listening(endpoint: str) -> bool:
    """Whether something accepts connections at ``host:port`` (a store being up)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        add_scenario_arguments(
            parser,
            default_launchers=f"{', '.join(DEFAULT_VARIANTS['quick'])}; smoke: {', '.join(DEFAULT_VARIANTS['smoke'])}",
        )
        parser.add_argument(
            "--kinds", type=lambda s: tuple(s.split(",")), default=KINDS, help=f"from {', '.join(KINDS)}"
        )
        parser.add_argument("--events", type=int, default=None, help="failures per kind (default by mode)")
        parser.add_argument(
            "--hang-timeout",
            type=float,
            default=HANG_TIMEOUT_S,
            help=f"hyperpodrun's --hang-timeout, s [{HANG_TIMEOUT_S:g}]",
        )
        parser.add_argument("--seed", type=int, default=0, help="seed of the failure steps [0]")
        parser.add_argument(
            "--at-checkpoints",
            choices=("yes", "no"),
            default=None,
            help="whether a failure may fall on a checkpoint step [yes; smoke: no]",
        )

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    resolve_node_shape(args)
    args.launchers = chosen_launchers(args, DEFAULT_VARIANTS)
    layouts = chosen_layouts(args)
    for k in args.kinds:
        if k not in KINDS:
            raise SystemExit(f"--kinds: unknown failure kind {k!r}; choose from {', '.join(KINDS)}")
    timers = FailureTimers(
        step_time_s=args.step_time, hang_timeout_s=args.hang_timeout, nproc_per_node=args.nproc_per_node
    )
    train = TrainArgs.from_namespace(args, steps=1_000_000, min_step_time=args.step_time, ckpt_every=args.ckpt_every)
    count = args.events if args.events is not None else EVENTS_PER_KIND[args.mode]
    if count < 1:
        raise SystemExit(f"--events: must be >= 1, got {count}")
    settle = SETTLE_STEPS[args.mode]
    at_checkpoints = (args.at_checkpoints or ("no" if args.mode == "smoke" else "yes")) == "yes"
    plan = failure_plan(
        args.kinds,
        count,
        seed=args.seed,
        first=settle,
        min_gap=settle + 1,
        ckpt_every=args.ckpt_every,
        at_checkpoints=at_checkpoints,
    )
    event_timeout = args.event_timeout or EVENT_TIMEOUT_S[args.mode]
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "plan": [f"{k} at step {s}" for k, s in plan],
            "seed": args.seed,
            "launchers": list(args.launchers),
            "failures_at_checkpoint_steps": at_checkpoints,
            "timers": dataclasses.asdict(timers),
            "event_timeout_s": event_timeout,
            "settle_steps": settle,
            "train": train.as_params(),
            "nodes": 2,
            "nproc_per_node": timers.nproc_per_node,
            "nnodes": "1:2",
            "layouts": {layout: list(LAYOUT_FLAGS[layout]) for layout in layouts},
        },
        baseline="torchrun --nnodes 1:2 (c10d, --max-restarts), the same script and failures in the same run: "
        "every worker restarts and resumes from the last periodic checkpoint",
    )
    runs = run_variants(
        FailureScenario,
        args.launchers,
        lambda scenario: scenario.run_failures(plan),
        name=NAME,
        out=args.out,
        train=train,
        timers=timers,
        event_timeout=event_timeout,
        settle_steps=settle,
        layouts=layouts,
    )

    def summarize(part: list[dict[str, Any]]) -> dict[str, Any]:
        return summarize_failures(part, launchers=args.launchers, kinds=args.kinds, timers=timers)

    summary = summarize_by_layout(runs, summarize) if layouts else summarize(runs)
    result.samples["runs"] = runs
    result.summary = summary
    result.notes += [
        "Downtime runs from the end of the last step rank 0 logged before the kill to the end of the first step "
        "it logged after (one step time included); lost time adds the steps redone x the step time.",
        "The restarting variants resume from the last periodic checkpoint: their steps lost depend on where in "
        "the checkpoint interval the failure falls (seeded, the same steps for every variant).",
        "All nodes share this machine's CPUs; process start-up (Python + torch import) is a large part of every "
        "restart here and is slower when the machine is busy.",
    ]
    if layouts:
        plot_layouts(result, summary["layout_comparison"], result.plot_path(args.out))
    else:
        plot(result, runs, summary, result.plot_path(args.out))
    path = result.write(args.out)
    print_report(runs, summary)
    print(f"wrote {path}")
    return 0


def summarize_failures(
    runs: list[dict[str, Any]], *, launchers: tuple[str, ...], kinds: tuple[str, ...], timers: FailureTimers
) -> dict[str, Any]:
    """Medians and ratios per failure kind and variant, phases, rejoins, bytes moved, modes, the targets."""
    summary = summarize_events(runs)
    summary["phases_from_failure_median_s"] = phase_medians(runs)
    summary["rejoin_after_node_loss"] = rejoin_summary(runs)
    summary["hyperpodrun_spans"] = phase_breakdown(runs)
    summary["hyperpodrun_bytes_moved"] = moved_by_kind(runs)
    summary["modes"] = {run["variant"]: [ev.get("mode") for ev in run["events"]] for run in runs}
    summary["job_deaths"] = {run["variant"]: int(run["failure"] is not None) for run in runs}
    baseline = next((v for v in ("torchrun-noshare", "torchrun") if v in launchers), None)
    if "hyperpodrun" in launchers:
        summary["targets"] = {
            k: target_report(
                summary, kind=k, baseline=baseline or "torchrun-noshare", hang_timeout_s=timers.hang_timeout_s
            )
            for k in kinds
        }
    return summary


def print_report(runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The events, one row each, then each layout's summary lines (the one summary without ``--layouts``)."""
    rows = []
    for run in runs:
        for ev in run["events"]:
            ph = ev.get("phases_s") or {}
            rows.append(
                (
                    run_label(run),
                    ev["kind"],
                    ev.get("last_old_step", ev["at_step"]),
                    ev["outcome"],
                    ev.get("mode", "-"),
                    ev.get("downtime_s"),
                    ev.get("steps_lost"),
                    ev.get("lost_time_s"),
                    ev.get("detect_s"),
                    ph.get("group_torn_down"),
                    ph.get("group_up"),
                    ph.get("hydrated"),
                    ph.get("first_step"),
                )
            )
    print(
        format_table(
            [
                "launcher",
                "event",
                "step",
                "outcome",
                "mode",
                "downtime s",
                "steps lost",
                "lost time s",
                "detect s",
                "torn down",
                "group up",
                "hydrated",
                "first step",
            ],
            rows,
        )
    )
    for run in runs:
        for ev in run["events"]:
            if ev.get("rejoin", {}).get("outcome") == "ok":
                r = ev["rejoin"]
                print(
                    f"{run_label(run)}: node {ev['node']} started again after its loss at step {ev['last_old_step']}: "
                    f"{r['mode']}, downtime {_fmt(r['downtime_s'])} s, steps lost {r['steps_lost']}"
                )
    for layout, part in summary["by_layout"].items() if "by_layout" in summary else ((None, summary),):
        print_summary(part, prefix=f"[{layout}] " if layout else "")


def print_summary(summary: dict[str, Any], *, prefix: str = "") -> None:
    for kind, by_variant in summary["by_kind"].items():
        for variant, s in by_variant.items():
            print(
                f"{prefix}{kind} {variant}: {s['ok']}/{s['n']} ok, median downtime {_fmt(s['downtime_median_s'])} s, "
                f"steps lost {_fmt(s['steps_lost_median'])}, lost time {_fmt(s['lost_time_median_s'])} s, "
                f"detect {_fmt(s['detect_median_s'])} s"
            )
    for ratio in ("downtime_ratio", "lost_time_ratio"):
        for ours, by_base in summary[ratio].items():
            for base, ratios in by_base.items():
                print(f"{prefix}{ratio} {ours} / {base}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    for kind, report in (summary.get("targets") or {}).items():
        print(
            f"{prefix}issue 11 targets, {kind}: "
            + ", ".join(
                f"{name} {_fmt(t['value'])} (<= {t['target']:g}: {'met' if t['met'] else 'not met' if t['met'] is False else '-'})"
                for name, t in report.items()
            )
        )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
