"""Scale events: downtime, lost steps and phases, hyperpodrun in place / restarting against torchrun.

The same training script (the example trainer: tiny Llama, ``ElasticTraining``,
``--min-step-time`` for a fixed step time, periodic checkpoints every ``--ckpt-every``
steps) runs through one scenario under each launcher variant, one launcher process per
simulated node, all on this machine:

    node A starts (and hosts the rendezvous store; it is never stopped)
    join    node B starts                                     world 1 -> 2
    leave   node B gets SIGTERM (graceful)                    world 2 -> 1
    join    node C starts                                     world 1 -> 2
    yield   ``hyperpodctl yield 1`` (torchrun: SIGTERM to C)  world 2 -> 1
    rejoin  ``hyperpodctl uncap``: the yielded node, parked as a standby, comes back
            (torchrun: C starts again)                        world 1 -> 2
    leave   node C gets SIGTERM                               world 2 -> 1

(``--smoke``: join and yield only; full mode runs the cycle twice, with nodes D and E.)
Variants:

* ``hyperpodrun``: ``--restart-mode auto`` (default): every rank uses ``ElasticTraining``,
  so survivors reconfigure in place and a joiner, started parked, hydrates from peers;
* ``hyperpodrun-restart``: ``--restart-mode process``: ranks save at the agreed step, exit,
  restart at the new size and load the checkpoint;
* ``torchrun --nnodes 1:2 --rdzv-backend c10d``, twice: with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``torchrun-noshare``) and as shipped (on torch
  2.13 CPU its scale-up can deadlock). torchrun restarts every worker; the script resumes
  from its last periodic checkpoint and recomputes the steps since.

Per event, from rank 0's per-step log (``--metrics``, step end times): downtime = end of
the first step at the new size minus end of the last step before it (one step included);
pause = downtime minus a normal step (the time no rank trained); steps lost = last step
before the event minus the step the new size resumed from; time to detect = event until
the launcher acted (hyperpodrun: ``scale_decided`` in its event log; torchrun: its agent's
"will restart worker group" line); hyperpodrun's phases from its event log. With torchft
installed (``pip install -e .[torchft]``) a replica group of torchft joins and leaves the
same way (``torchft_peer.py``) and the survivors' pause is reported beside ours.

A launcher that hangs or exits is recorded as such, with its output tail, and its scenario
stops there. Every launcher run has a hard deadline and every process tree is killed at the end.

A simulated node holds 2 ranks (``--smoke``: 1, for CI's 2 cores) and the global batch is 4 samples a rank of
a node, unless ``--nproc-per-node`` and ``--global-batch`` say otherwise; a join or leave adds or removes a
whole node.

``--layouts ddp,fsdp,hsdp`` runs every launcher variant once per model layout (a replicated model, FSDP2
over the world, HSDP with a replica per node; :mod:`layouts`), all in the same run, and compares them.

    python benchmarks/scale_events.py [--quick | --smoke] [--launchers hyperpodrun,hyperpodrun-restart,torchrun-noshare,torchrun]
    python benchmarks/scale_events.py --quick --launchers hyperpodrun,torchrun-noshare --layouts ddp,fsdp,hsdp
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torchft_peer
from common import (
    BenchmarkError,
    BenchmarkResult,
    BenchmarkTimeoutError,
    ManagedProcess,
    OutputBus,
    TrainArgs,
    add_train_arguments,
    bench_env,
    format_table,
    free_port,
    hyperpodrun_cmd,
    parse_args,
    read_metrics,
    require_train_script,
    result_tag,
    torchrun_cmd,
)
from hyperpodrun.device_plan import DevicePlan
from layouts import LAYOUT_FLAGS, layout_train, parse_layouts, plot_layouts, run_label, summarize_by_layout
from scale_analysis import (
    OURS,
    VARIANTS,
    bytes_moved,
    event_mode,
    event_phase,
    hyperpodrun_phases,
    lost_time,
    measure_event,
    moved_by_kind,
    phase_breakdown,
    plot,
    summarize_events,
)

NAME = "scale_events"
#: The smoke run skips torchrun as shipped (its scale-up hang costs the whole event timeout)
#: and the restart variant (the same scenario with one flag changed).
DEFAULT_VARIANTS = {"smoke": ("hyperpodrun", "torchrun-noshare"), "quick": VARIANTS, "full": VARIANTS}
CYCLE = (("join", "B"), ("leave", "B"), ("join", "C"), ("yield", "C"), ("rejoin", "C"), ("leave", "C"))
SCENARIO = {
    "smoke": (("join", "B"), ("yield", "B")),
    "quick": CYCLE,
    "full": CYCLE + tuple((kind, {"B": "D", "C": "E"}[node]) for kind, node in CYCLE),
}
EVENT_TIMEOUT_S = {"smoke": 60.0, "quick": 90.0, "full": 120.0}
SETTLE_STEPS = {"smoke": 2, "quick": 4, "full": 6}
#: Ranks per simulated node unless --nproc-per-node says: a node of several ranks, as users run; the smoke's
#: one rank a node keeps CI's 2 cores from running 6 ranks (and their launchers) at once.
NPROC_PER_NODE = {"smoke": 1, "quick": 2, "full": 2}
#: Samples per step and rank of the default global batch (--global-batch): 4 a node of 1 rank, 8 of 2.
BATCH_PER_NODE_RANK = 4
STARTUP_TIMEOUT_S = 180.0
CTL_TIMEOUT_S = 30.0
DETECT_TORCHRUN = re.compile(r"will restart worker group")
KIND_WORLD = {"join": +1, "leave": -1, "yield": -1, "rejoin": +1, "loss": -1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timers:
    """The launchers' liveness and capacity timers, set alike so the comparison is fair."""

    step_time_s: float = 0.5
    lease_ttl_s: float = 3.0  # hyperpodrun membership lease; torchrun: keep-alive 1 s x 3 attempts
    scaling_timeout_s: float = 1.0  # hyperpodrun: capacity must be stable; torchrun: last_call_timeout
    min_stable_period_s: float = 1.0
    faulty_scale_down_timeout_s: float = 0.0  # shrink as soon as a lost node's lease expires
    graceful_shutdown_timeout_s: float = 60.0
    max_restarts: int = 20
    nproc_per_node: int = 1  # ranks per simulated node
    max_nodes: int = 2  # the job's --nnodes 1:max_nodes

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{f.name} must be a number >= 0, got {value!r}")
        for name in ("nproc_per_node", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.lease_ttl_s < 1:
            raise ValueError(
                f"lease_ttl_s must be >= 1 (torchrun's keep-alive is in whole seconds), got {self.lease_ttl_s!r}"
            )

    def launcher_args(self, variant: str, endpoint: str, run_id: str, work: Path, node: str) -> list[str]:
        """The launcher flags of ``node`` (every node of a job gets the same, but its own log folder)."""
        common = [
            "--nnodes",
            f"1:{self.max_nodes}",
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--max-restarts",
            str(self.max_restarts),
        ]
        if variant in OURS:
            mode = ["--restart-mode", "process"] if variant == "hyperpodrun-restart" else []
            return (
                common
                + mode
                + [
                    "--scaling-timeout",
                    f"{self.scaling_timeout_s:g}",
                    "--min-stable-period",
                    f"{self.min_stable_period_s:g}",
                    "--backoff-factor",
                    "1",  # no anti-thrashing backoff: events come back to back here
                    "--faulty-scale-down-timeout",
                    f"{self.faulty_scale_down_timeout_s:g}",
                    "--graceful-shutdown-timeout",
                    f"{self.graceful_shutdown_timeout_s:g}",
                    "--rdzv-conf",
                    f"lease_ttl={self.lease_ttl_s:g}",
                    "--event-log",
                    str(work / "events.jsonl"),
                    "--log-dir",
                    str(work / "logs" / node),  # one per node: attempt folders would collide
                ]
            )
        return common + ["--rdzv-conf", self.torchrun_rdzv_conf()]

    def torchrun_rdzv_conf(self) -> str:
        """torchrun's equivalents: keep-alive every 1 s for ``lease_ttl`` attempts; last call = scaling timeout."""
        return (
            f"last_call_timeout={max(1, round(self.scaling_timeout_s))},"
            f"keep_alive_interval=1,keep_alive_max_attempt={max(1, round(self.lease_ttl_s))}"
        )


# --------------------------------------------------------------------------- one launcher's scenario


class ScenarioFailed(BenchmarkError):
    """A launcher hung or exited during the scenario; ``outcome`` says which."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class Scenario:
    """Nodes of one launcher variant on this machine, driven through the event list."""

    def __init__(
        self,
        variant: str,
        train: TrainArgs,
        timers: Timers,
        *,
        work: Path,
        data_cache: Path,
        event_timeout: float,
        settle_steps: int,
    ) -> None:
        self.variant = variant
        self.train = train
        self.timers = timers
        self.work = work
        self.data_cache = data_cache
        self.event_timeout = event_timeout
        self.settle_steps = settle_steps
        self.bus = OutputBus()
        self.nodes: dict[str, ManagedProcess] = {}
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.run_id = f"bench-{variant}-{int(time.time())}"
        self.metrics = work / "metrics.jsonl"
        env = {"OMP_NUM_THREADS": "1"}
        if variant.startswith("torchrun"):
            env["LOGLEVEL"] = "INFO"  # the agent's restart decisions are logged at INFO
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1" if variant == "torchrun-noshare" else "0"
        self.env = bench_env(**env)
        self.env_settings = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
        # A on slot 0, B on 1, C on 2 ...; with 2 slots every later node shares slot 1 (one alive at a time)
        self.devices = DevicePlan.for_host(slots=timers.max_nodes, nproc=timers.nproc_per_node)
        if (note := self.devices.note()) is not None:
            print(f"{variant}: {note}", flush=True)

    # -- processes

    def start_node(self, name: str) -> float:
        script = str(require_train_script())
        argv = self.train.argv(run_dir=self.work / "run", data_cache=self.data_cache, metrics=self.metrics)
        flags = self.timers.launcher_args(self.variant, self.endpoint, self.run_id, self.work, name)
        launcher = hyperpodrun_cmd if self.variant in OURS else torchrun_cmd
        env = {**self.env, **self.devices.env(min(ord(name[0]) - ord("A"), self.timers.max_nodes - 1))}
        if name in self.nodes:  # started again after it left (torchrun's rejoin)
            self.nodes.pop(name).close()
        t = time.time()
        self.nodes[name] = ManagedProcess(
            launcher(*flags, script, *argv),
            name=name,
            env=env,
            bus=self.bus,
            log_path=self.work / f"node-{name}.log",
        )
        return t

    def close(self) -> dict[str, int | None]:
        codes = {name: node.poll() for name, node in self.nodes.items()}
        for name in sorted(self.nodes, reverse=True):  # the store's host (A) last
            self.nodes[name].close()
        return codes

    # -- waiting on the job

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics)

    def _check_host(self) -> None:
        host = self.nodes["A"]
        if host.poll() is not None:
            raise ScenarioFailed("exited", f"node A (the store host) exited with {host.poll()}:\n{host.tail(15)}")

    def wait_steps_at(
        self, world: int, steps: int, *, timeout: float, what: str, phase: int | None = None
    ) -> list[dict[str, Any]]:
        """Until rank 0 has logged ``steps`` steps at ``world`` since it last changed size
        (and, with ``phase``, its latest step is ``phase`` modulo the checkpoint interval)."""
        every = self.train.ckpt_every

        def ready(_: object) -> list[dict[str, Any]] | None:
            self._check_host()
            recs = self.records()
            tail = []
            for r in reversed(recs):
                if r["world_size"] != world:
                    break
                tail.append(r)
            if len(tail) < steps:
                return None
            return recs if phase is None or not every or tail[0]["step"] % every == phase else None

        return self.bus.wait_for(ready, timeout=timeout, what=what)

    def detect_time(self, t_event: float, t_end: float) -> float | None:
        """Seconds from the event to the launcher's decision to act on it (None if not seen)."""
        if self.variant in OURS:
            events = _read_jsonl(self.work / "events.jsonl")
            decided = [e["ts"] for e in events if e["event"] == "scale_decided" and t_event < e["ts"] <= t_end]
            return min(decided) - t_event if decided else None
        lines = [x.ts for x in self.bus.lines() if t_event < x.ts <= t_end and DETECT_TORCHRUN.search(x.text)]
        return min(lines) - t_event if lines else None

    # -- the scenario

    def drive(self, events: Iterable[Callable[[int], dict[str, Any]]]) -> dict[str, Any]:
        """Run ``events`` (each makes one event happen and measures it) until one fails; always closes the nodes.

        ``events`` is consumed lazily, so it may start nodes and wait before yielding each event.
        """
        out: dict[str, Any] = {"variant": self.variant, "env": self.env_settings, "events": [], "failure": None}
        try:
            for index, event in enumerate(events):
                ev = event(index)
                out["events"].append(ev)
                if ev["outcome"] != "ok":
                    out["failure"] = ev["error"]
                    break
        except (ScenarioFailed, BenchmarkTimeoutError) as e:
            out["failure"] = str(e)
        finally:
            out["exit_codes"] = self.close()
            out["timeline"] = [(r["ts"], r["step"], r["world_size"]) for r in self.records()]
        return out

    def run(self, events: tuple[tuple[str, str], ...]) -> dict[str, Any]:
        return self.drive(self._scale_events(events))

    def _scale_events(self, events: tuple[tuple[str, str], ...]) -> Iterator[Callable[[int], dict[str, Any]]]:
        nproc = self.timers.nproc_per_node  # worlds count ranks: a node brings or takes this many
        self.start_node("A")
        self.wait_steps_at(
            nproc, self.settle_steps, timeout=STARTUP_TIMEOUT_S, what=f"{self.variant}: node A's first steps"
        )
        world = nproc
        for index, (kind, node) in enumerate(events):
            target = world + KIND_WORLD[kind] * nproc
            phase = event_phase(index, self.train.ckpt_every)
            what = f"{self.variant}: step {phase} of the checkpoint interval at world {world}"
            self.wait_steps_at(world, self.settle_steps, phase=phase, timeout=self.event_timeout, what=what)
            yield functools.partial(self._event, kind=kind, node=node, world=world, target=target)
            world = target

    def _event(self, index: int, *, kind: str, node: str, world: int, target: int) -> dict[str, Any]:
        print(f"{NAME}: {self.variant}: event {index + 1} {kind} ({node}), world {world} -> {target}", flush=True)
        t_event = self._trigger(kind, node)
        ev: dict[str, Any] = {
            "index": index,
            "kind": kind,
            "node": node,
            "from_world": world,
            "to_world": target,
            "t_event": t_event,
        }
        try:
            self.bus.wait_for(
                lambda _: self._check_host() or measure_event(self.records(), t_event=t_event, to_world=target),
                timeout=self.event_timeout,
                what=f"{self.variant}: first step at world {target} after the {kind} of node {node}",
            )
            # Settle at the new size before the next event (and so the measurement is final).
            self.wait_steps_at(
                target, self.settle_steps, timeout=self.event_timeout, what=f"{self.variant}: steps at world {target}"
            )
        except BenchmarkTimeoutError as e:
            return {**ev, "outcome": "hang", "error": f"{e}; last output:\n{self._tails()}"}
        except ScenarioFailed as e:
            return {**ev, "outcome": e.outcome, "error": str(e)}
        measured = measure_event(self.records(), t_event=t_event, to_world=target)
        assert measured is not None  # waited for above
        t_end = measured["first_new_ts"]
        ev.update(outcome="ok", **measured, detect_s=self.detect_time(t_event, t_end))
        ev["lost_time_s"] = lost_time(ev["downtime_s"], ev["steps_lost"], self.timers.step_time_s)
        if self.variant in OURS:
            log = _read_jsonl(self.work / "events.jsonl")
            ev["phases_s"] = hyperpodrun_phases(log, t_event)
            ev["bytes_moved"] = bytes_moved(log, t_event)
            ev["mode"] = event_mode(log, ev["phases_s"], t_event)
        return ev

    def _trigger(self, kind: str, node: str) -> float:
        """Make the event happen; returns its time. yield and rejoin go through hyperpodctl for hyperpodrun."""
        ctl = self.variant in OURS
        if kind == "join" or (kind == "rejoin" and not ctl):
            return self.start_node(node)
        if kind == "rejoin" and self.nodes[node].poll() is not None:  # not kept as a standby: start it again
            self.start_node(node)
        t_event = time.time()
        if kind in ("yield", "rejoin") and ctl:
            self.hyperpodctl("yield", "1") if kind == "yield" else self.hyperpodctl("uncap")
        elif kind in ("leave", "yield"):
            self.nodes[node].signal(signal.SIGTERM)
        elif kind == "loss":
            self.nodes[node].kill_tree()
        else:
            raise ValueError(f"unknown event kind {kind!r}")
        return t_event

    def hyperpodctl(self, *args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "hyperpodrun.ctl",
            *args,
            "--rdzv-id",
            self.run_id,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.endpoint,
        ]
        try:
            done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=CTL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise ScenarioFailed(
                "hang", f"hyperpodctl {' '.join(args)} did not return in {CTL_TIMEOUT_S:g} s"
            ) from None
        if done.returncode != 0:
            raise ScenarioFailed(
                "exited", f"hyperpodctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )

    def _tails(self) -> str:
        return "\n".join(node.tail(8) for node in self.nodes.values())


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return read_metrics(path)  # the same tolerant JSON-lines reader


# --------------------------------------------------------------------------- driver


def torchft_ratios(summary: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """Survivors' pause, hyperpodrun in place over torchft, per event kind both ran (leave: ours graceful)."""
    out = {}
    for kind in ("join", "leave"):
        ours = summary["by_kind"].get(kind, {}).get("hyperpodrun", {}).get("pause_median_s")
        theirs = (peer.get(kind) or {}).get("pause_median_s")
        if ours is not None and theirs:
            out[kind] = ours / theirs
    return out


def resolve_node_shape(args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on the mode: ranks per node, then a global batch of
    :data:`BATCH_PER_NODE_RANK` samples per rank of a node."""
    if args.nproc_per_node is None:
        args.nproc_per_node = NPROC_PER_NODE[args.mode]
    if args.global_batch is None:
        args.global_batch = BATCH_PER_NODE_RANK * args.nproc_per_node


def add_scenario_arguments(parser: argparse.ArgumentParser, *, default_launchers: str) -> None:
    """The options of a launcher-variant scenario (also ``failures.py``'s)."""
    parser.add_argument(
        "--launchers",
        type=lambda s: tuple(s.split(",")),
        default=None,
        help=f"from {', '.join(VARIANTS)} (default: {default_launchers})",
    )
    parser.add_argument("--step-time", type=float, default=Timers.step_time_s, help="fixed step time, s")
    parser.add_argument("--ckpt-every", type=int, default=10, help="periodic checkpoint interval, steps [10]")
    parser.add_argument("--event-timeout", type=float, default=None, help="hard limit per event, s")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help=f"ranks per simulated node [{NPROC_PER_NODE['quick']}; --smoke: {NPROC_PER_NODE['smoke']}]; with "
        "--train-args=--hsdp a node is one replica",
    )
    parser.add_argument(
        "--layouts",
        default=None,
        help="run every launcher once per model layout, from ddp,fsdp,hsdp (e.g. ddp,fsdp,hsdp), and compare them",
    )
    add_train_arguments(
        parser, global_batch=None, micro_batch=2, global_batch_is=f"{BATCH_PER_NODE_RANK} per rank of a node"
    )
    parser.set_defaults(seq_len=128)


def chosen_layouts(args: argparse.Namespace) -> tuple[str, ...]:
    """``--layouts`` checked (else one line and exit); () without it: the one layout ``--train-args`` gives."""
    if args.layouts is None:
        return ()
    try:
        return parse_layouts(args.layouts, train_extra=shlex.split(args.train_args or ""))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def chosen_launchers(args: argparse.Namespace, defaults: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """``--launchers`` or the mode's default, each a known variant (else one line and exit)."""
    for v in args.launchers or ():
        if v not in VARIANTS:
            raise SystemExit(f"--launchers: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    return args.launchers or defaults[args.mode]


def run_variants(
    scenario_type: type[Scenario],
    launchers: tuple[str, ...],
    drive: Callable[[Scenario], dict[str, Any]],
    *,
    name: str,
    out: Path,
    train: TrainArgs,
    layouts: tuple[str, ...] = (),
    **settings: Any,
) -> list[dict[str, Any]]:
    """One scenario per launcher variant, one after the other, in ``out/work/<name>/<variant>``; with
    ``layouts``, every variant once per layout (``out/work/<name>/<layout>/<variant>``), each run marked with it."""
    work_root = out / "work" / name
    shutil.rmtree(work_root, ignore_errors=True)
    runs = []
    for layout in layouts or (None,):
        for variant in launchers:
            work = work_root / variant if layout is None else work_root / layout / variant
            run_train = train if layout is None else layout_train(train, layout)
            if layout is not None:
                print(f"{name}: {variant}, layout {layout} ...", flush=True)
            run = drive(scenario_type(variant, work=work, data_cache=out / "data-cache", train=run_train, **settings))
            if layout is not None:
                run["layout"] = layout
            runs.append(run)
            if run["failure"]:
                print(f"{name}: {run_label(run)} failed: {run['failure'].splitlines()[0]}", flush=True)
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ratios per event kind and variant, hyperpodrun's phases, bytes moved and modes."""
    summary = summarize_events(runs)
    summary["hyperpodrun_phases"] = phase_breakdown(runs)
    summary["hyperpodrun_bytes_moved"] = moved_by_kind(runs)
    summary["hyperpodrun_modes"] = {
        run["variant"]: [ev.get("mode") for ev in run["events"]] for run in runs if run["variant"] in OURS
    }
    return summary


def print_ratios(summary: dict[str, Any], *, prefix: str = "") -> None:
    for ratio in ("downtime_ratio", "lost_time_ratio"):
        for ours, by_base in summary[ratio].items():
            for base, ratios in by_base.items():
                print(f"{prefix}{ratio} {ours} / {base}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    for variant, phases in summary["hyperpodrun_phases"].items():
        print(
            f"{prefix}{variant} phases, median s: "
            + ", ".join(f"{k.removesuffix('_median_s')} {v:.2f}" for k, v in phases.items() if v is not None)
        )


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        add_scenario_arguments(parser, default_launchers=f"all; smoke: {', '.join(DEFAULT_VARIANTS['smoke'])}")

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    resolve_node_shape(args)
    args.launchers = chosen_launchers(args, DEFAULT_VARIANTS)
    layouts = chosen_layouts(args)
    timers = Timers(step_time_s=args.step_time, nproc_per_node=args.nproc_per_node)
    train = TrainArgs.from_namespace(args, steps=1_000_000, min_step_time=args.step_time, ckpt_every=args.ckpt_every)
    events = SCENARIO[args.mode]
    event_timeout = args.event_timeout or EVENT_TIMEOUT_S[args.mode]
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "launchers": list(args.launchers),
            "scenario": [f"{k} {n}" for k, n in events],
            "timers": dataclasses.asdict(timers),
            "event_timeout_s": event_timeout,
            "settle_steps": SETTLE_STEPS[args.mode],
            "train": train.as_params(),
            "event_after_step_mod_ckpt_every": [event_phase(i, args.ckpt_every) for i in range(len(events))],
            "nproc_per_node": timers.nproc_per_node,
            "nnodes": "1:2",
            "rdzv_backend": "c10d (hyperpodrun: embedded store; torchrun: TCPStore)",
            "torchrun_rdzv_conf": timers.torchrun_rdzv_conf(),
            "layouts": {layout: list(LAYOUT_FLAGS[layout]) for layout in layouts},
        },
        baseline="torchrun --nnodes 1:2 (c10d), the same script and scenario in the same run, with and without "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (yield = SIGTERM of the newest node; rejoin = it starts again)",
    )
    runs = run_variants(
        Scenario,
        args.launchers,
        lambda scenario: scenario.run(events),
        name=NAME,
        out=args.out,
        train=train,
        timers=timers,
        event_timeout=event_timeout,
        settle_steps=SETTLE_STEPS[args.mode],
        layouts=layouts,
    )
    summary = summarize_by_layout(runs, summarize) if layouts else summarize(runs)
    result.samples["runs"] = runs
    result.summary = summary
    if layouts:
        print(f"{NAME}: torchft's peer scenario runs without --layouts (it has one layout)")
    elif torchft_peer.available():
        print(f"{NAME}: torchft {torchft_peer.CYCLES[args.mode]} join/leave cycle(s) ...", flush=True)
        try:
            peer = torchft_peer.measure(args.mode, args.out / "work" / NAME / "torchft")
        except BenchmarkError as e:
            peer = {"failure": str(e), "summary": {}, "events": []}
        result.samples["torchft"] = peer
        summary["torchft"] = {
            **peer["summary"],
            "failure": peer["failure"],
            "pause_ratio_hyperpodrun_over_torchft": torchft_ratios(summary, peer["summary"]),
        }
    else:
        print(f"{NAME}: torchft is not installed (pip install -e .[torchft]): its peer scenario is skipped")
    result.notes += [
        (
            "Downtime runs from the end of the last step before the change to the end of the first step at "
            "the new size (one step time included), read from rank 0's per-step log; process start, "
            "rendezvous, process-group setup and checkpoint load all fall inside it. pause = downtime minus "
            "the median step interval just before the event: the time no rank trained."
        ),
        (
            "torchrun has no yield: its yield is a SIGTERM to the newest node, and its rejoin starts that node "
            "again (hyperpodrun's yielded node waits parked as a standby and comes back on hyperpodctl uncap)."
        ),
        (
            "torchrun restarts every worker on a membership change and the script resumes from its last "
            "periodic checkpoint: its steps lost depend on where in the checkpoint interval the event falls."
        ),
        (
            "All nodes share this machine's CPUs; process start-up (Python + torch import) is a large part "
            "of every restart here and is slower when the machine is busy."
        ),
    ]
    if layouts:
        plot_layouts(result, summary["layout_comparison"], result.plot_path(args.out))
    else:
        plot(result, runs, summary, result.plot_path(args.out))
    path = result.write(args.out)
    rows = []
    for run in runs:
        for ev in run["events"]:
            rows.append(
                (
                    run_label(run),
                    f"{ev['kind']} {ev['node']}",
                    f"{ev['from_world']}->{ev['to_world']}",
                    ev["outcome"],
                    ev.get("mode", "-"),
                    ev.get("downtime_s"),
                    ev.get("pause_s"),
                    ev.get("steps_lost"),
                    ev.get("lost_time_s"),
                    ev.get("detect_s"),
                )
            )
    print(
        format_table(
            [
                "launcher",
                "event",
                "world",
                "outcome",
                "mode",
                "downtime s",
                "pause s",
                "steps lost",
                "lost time s",
                "detect s",
            ],
            rows,
        )
    )
    for layout, part in summary["by_layout"].items() if layouts else ((None, summary),):
        print_ratios(part, prefix=f"[{layout}] " if layout else "")
    if "torchft" in summary:
        ft = summary["torchft"]
        print(
            "torchft survivors' pause, median s: "
            + ", ".join(
                f"{k} {ft[k]['pause_median_s']:.3f}"
                for k in ("join", "leave")
                if (ft.get(k) or {}).get("pause_median_s") is not None
            )
            + "; hyperpodrun in place / torchft: "
            + ", ".join(f"{k} {v:.2f}" for k, v in ft["pause_ratio_hyperpodrun_over_torchft"].items())
            + (f"; stopped: {ft['failure'].splitlines()[0]}" if ft["failure"] else "")
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
