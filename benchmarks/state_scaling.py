"""State scaling: what snapshots, hydration, scale events and repairs cost as the state per rank grows.

The example trainer (``--fsdp``, fp32, ``ElasticTraining``) runs at each model size (``--sizes``:
presets of ``examples/llama_finetune/model.py``) on 2 simulated nodes x 2 ranks (one
``hyperpodrun`` per node, ``--nproc-per-node 2``, ``--snapshot-every auto``, the default), all on
this machine, and goes through, size by size:

    steady      A and B train at world 4 until ``auto`` has chosen the round's snapshot interval,
                then a window of steps: step time, snapshot figures, peak RSS per rank
    join        node C starts (world 4 -> 6; skipped when memory does not allow 3 x 2)
    leave       node C gets SIGTERM (graceful, world 6 -> 4)
    rank_crash  kill -9 of B's last rank (its sibling on B survives; world stays 4), at a seeded step
                of the snapshot interval chosen for the round
    node_loss   kill -9 of B's launcher tree (world 4 -> 2), the same way

then, at the same size and in the same run: ``torchrun`` (c10d, no shared store) on the same
2 x 2 and the same steps (the throughput baseline), and ``hydration.measure`` (a model with
as many parameters, its parameters and AdamW state hydrated, broadcast and copied in memory on
a gloo group of 2 ranks: the bandwidth bounds).

Per size (the summary's ``sizes``): parameters; the rank's training state (fp32 parameters,
gradients and AdamW's two moments: 16 bytes a parameter, over 4 ranks); what the snapshots hold
(``snapshot_held_bytes`` over the local state they copy); the interval ``auto`` chose, the step
time a snapshot costs and its share of the step (``snapshot_overhead``, from the round's own
calibration: the ``snapshot_interval`` record), one snapshot chain's time and bandwidth; the
peak RSS of a rank (``VmHWM``) over its state, and the process floor (a parked spare rank's RSS);
each event's downtime, survivors' pause and steps redone (``scale_analysis.measure_event`` /
``failure_analysis.measure_failure`` on rank 0's step log); throughput over torchrun's;
hydration over broadcast and over memcpy.

    python benchmarks/state_scaling.py [--quick | --smoke] [--sizes tiny,llama-25m] [--kinds join,leave,rank_crash,node_loss]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

import hydration
from common import (
    REPO_ROOT,
    BenchmarkError,
    BenchmarkResult,
    TrainArgs,
    format_table,
    median,
    parse_args,
    pyplot,
    result_tag,
)
from failures import FailureScenario, FailureTimers

NAME = "state_scaling"
SIZES = {
    "smoke": ("tiny",),
    "quick": ("tiny", "llama-25m", "llama-125m"),
    "full": ("tiny", "llama-25m", "llama-125m", "llama-300m"),
}
KINDS = ("join", "leave", "rank_crash", "node_loss")
DEFAULT_KINDS = {"smoke": KINDS, "quick": KINDS, "full": KINDS}
NPROC = 2  # ranks per simulated node
#: fp32 weights, their gradients and AdamW's two moments: the training state of one parameter.
BYTES_PER_PARAM = 16
#: The steady window at world 4: the chosen interval's steps, at least the first and at most the second.
WINDOW = {"smoke": (3, 3), "quick": (6, 8), "full": (12, 40)}
SETTLE_STEPS = {"smoke": 2, "quick": 2, "full": 3}
#: A failure falls at a seeded step of the interval, at most this many steps after the round chose it.
MAX_FAILURE_WAIT = {"smoke": 2, "quick": 6, "full": 40}
TORCHRUN = {"smoke": False, "quick": True, "full": True}
HYDRATION_REPS = {"smoke": 2, "quick": 3, "full": 5}
EVENT_TIMEOUT_S = {"smoke": 90.0, "quick": 180.0, "full": 300.0}
HANG_TIMEOUT_S = 120.0
LEASE_TTL_S = 10.0
#: An in-place event must be done within this of its publication: the ranks first run on to the target step
#: (a few steps: 15-20 s each at 125M on a loaded 2-core machine), then gather and hydrate the state.
GRACEFUL_TIMEOUT_S = 600.0
#: Host memory kept free beside the job when deciding whether a third node fits (other work shares it).
MEMORY_MARGIN = 3 * 2**30
TARGETS = {
    "snapshot_overhead": 0.02,
    "join_pause_s": 0.010,
    "hydration_over_broadcast": 0.8,
    "peak_rss_over_state": 3.2,
    "crash_downtime_s_at_125m": 2.0,
    "throughput_ratio_vs_torchrun": 0.98,
}


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, kw_only=True)
class Steady:
    """The steady window at world 4 of one size: the round's snapshot choice, step times and memory."""

    interval: int | None  # steps between snapshots the round chose (None: no snapshot_interval record)
    cost_s: float | None  # the step time one snapshot costs, from the round's calibration
    calib_step_s: float | None  # a step without a snapshot beside it, from the same calibration
    overhead: float | None  # cost / (interval x step): the snapshots' share of step time
    chosen_at_step: int | None
    first_step: int  # the window: rank 0's steps first_step .. last_step
    last_step: int
    step_s: float  # mean step time over the window (end to end)
    snapshot_state_bytes: int | None  # the local state a snapshot copies (rank 0's)
    snapshot_held_bytes: int | None  # what rank 0's snapshots hold (its neighbour's two and its own)
    chain_s: float | None  # median time of one snapshot chain over the window (sent until every copy exists)
    peak_rss_bytes: int  # the largest VmHWM among the 4 ranks at the window's end


@dataclasses.dataclass(frozen=True, kw_only=True)
class SizeResult:
    """One size's figures (the summary's ``sizes`` entries)."""

    model: str
    params: int
    state_bytes_per_rank: int
    snapshot_state_bytes: int | None
    snapshot_held_bytes: int | None
    snapshot_memory_ratio: float | None
    snapshot_interval: int | None
    snapshot_cost_s: float | None
    snapshot_overhead: float | None
    snapshot_chain_s: float | None
    snapshot_mb_per_s: float | None
    step_s: float | None
    torchrun_step_s: float | None
    throughput_ratio_vs_torchrun: float | None
    peak_rss_bytes: int | None
    floor_rss_bytes: int | None
    peak_rss_over_state: float | None
    peak_rss_less_floor_over_state: float | None
    join_world: int | None
    join_downtime_s: float | None
    join_pause_s: float | None
    join_hydration_s: float | None
    leave_downtime_s: float | None
    leave_pause_s: float | None
    crash_downtime_s: float | None
    crash_pause_s: float | None
    crash_steps_redone: int | None
    crash_interval: int | None
    crash_restored_from: str | None
    node_loss_downtime_s: float | None
    node_loss_pause_s: float | None
    node_loss_steps_redone: int | None
    node_loss_interval: int | None
    node_loss_restored_from: str | None
    hydration_mb_per_s: float
    broadcast_mb_per_s: float
    memcpy_mb_per_s: float
    hydration_over_broadcast: float
    hydration_over_memcpy: float
    outcomes: dict[str, str]
    failure: str | None


# --------------------------------------------------------------------------- memory


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set (``VmHWM``) in bytes; None if it is gone."""
    return _status_kb(pid, "VmHWM:")


def current_rss(pid: int) -> int | None:
    return _status_kb(pid, "VmRSS:")


def _status_kb(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# --------------------------------------------------------------------------- one size


class ScalingScenario(FailureScenario):
    """Nodes of ``NPROC`` ranks under hyperpodrun (or torchrun, for the baseline's steady window only)."""

    rejoin_after_loss = False  # the node loss is the scenario's last event

    def __init__(self, *args: Any, window: tuple[int, int], max_failure_wait: int, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = window
        self.max_failure_wait = max_failure_wait
        self.rng = random.Random(seed)
        self.steady: Steady | None = None
        self.join_skipped: str | None = None
        self.floor_rss_bytes: int | None = None

    # -- what the logs say

    def choices(self, after_ts: float = 0.0) -> list[dict[str, Any]]:
        """The ``snapshot_interval`` records logged after ``after_ts`` (one per rank per round)."""
        return [r for r in self.event_log() if r["event"] == "snapshot_interval" and r["ts"] > after_ts]

    def wait_for_choice(self, world: int, *, after_ts: float, what: str) -> dict[str, Any] | None:
        """Until the round at ``world`` has chosen its snapshot interval (None: the launcher's interval is
        fixed, or torchrun: no record comes; the wait is then a settle of a few steps)."""
        if self.variant != "hyperpodrun":
            self.wait_steps_at(world, self.settle_steps, timeout=self.event_timeout, what=what)
            return None

        def chosen(_: object) -> dict[str, Any] | None:
            self._check_job()
            found = self.choices(after_ts)
            return found[-1] if found else None

        return self.bus.wait_for(chosen, timeout=self.event_timeout, what=what)

    # -- the scenario

    def run_size(self, kinds: Sequence[str], *, steady_steps: tuple[int, int] | None = None) -> dict[str, Any]:
        """Drive the scenario; ``steady_steps``: the steady window's first and last step (another run's)."""
        out = self.drive(self._events(kinds, steady_steps=steady_steps))
        out["steady"] = dataclasses.asdict(self.steady) if self.steady is not None else None
        out["join_skipped"] = self.join_skipped
        out["floor_rss_bytes"] = self.floor_rss_bytes
        return out

    def close(self) -> dict[str, int | None]:
        self.floor_rss_bytes = self._spare_rss()  # node A's spare is parked, its state never built
        return super().close()

    def _events(
        self, kinds: Sequence[str], *, steady_steps: tuple[int, int] | None
    ) -> Iterator[Callable[[int], dict[str, Any]]]:
        full = self.start_two_nodes(steps=1)
        self.steady = self._steady(full, steady_steps)
        if self.variant != "hyperpodrun":
            return
        t_last = 0.0  # the round's choice made before the steady window applies to the first failure
        if "join" in kinds:
            self.join_skipped = self._join_blocked()
        if "join" in kinds and self.join_skipped is None:
            grown = full + NPROC
            yield functools.partial(self._event, kind="join", node="C", world=full, target=grown)
            if "leave" in kinds:
                yield functools.partial(self._leave, node="C", world=grown, target=full)
            t_last = time.time()
        for kind in ("rank_crash", "node_loss"):
            if kind in kinds:
                step = self._failure_step(full, after_ts=t_last)
                yield functools.partial(self._failure, kind=kind, step=step)
                t_last = time.time()

    def _steady(self, world: int, steps: tuple[int, int] | None) -> Steady:
        """The steady window at ``world``: after the round's snapshot choice and its spares (hyperpodrun), the
        chosen interval's steps within :attr:`window`; ``steps``: another run's window (torchrun's: the same)."""
        record = self.wait_for_choice(
            world, after_ts=0.0, what=f"{self.variant}: the snapshot interval at world {world}"
        )
        if self.variant == "hyperpodrun":  # each node starts a spare rank early on: the window starts after
            self.bus.wait_for(
                lambda _: self._check_job() or len(self._spares()) >= len(self.nodes),
                timeout=self.event_timeout,
                what=f"{self.variant}: a spare rank ready on every node",
            )
        start = self.records()[-1]["step"] + 1  # the first step that ends after the spares are up
        lo, hi = self.window
        every = int(record["every"]) if record is not None else None
        start, last = steps if steps is not None else (start, start + min(hi, max(lo, every or lo)))
        for step in range(start, last + 1):  # each step gets the event timeout: a large model's steps are long
            self.wait_step(step, world=world, what=f"{self.variant}: step {step} at world {world}")
        window = [r for r in self.records() if r["world_size"] == world and start <= r["step"] <= last]
        if len(window) < 2:
            raise BenchmarkError(f"{self.variant}: fewer than 2 steps logged between steps {start} and {last}")
        first, end = window[0], window[-1]
        # each record repeats the last completed chain's time until the next one completes: one value per chain
        logged = [r.get("snapshot_chain_s") for r in window]
        chains = [c for i, c in enumerate(logged) if c and (i == 0 or c != logged[i - 1])]
        ranks = [pid for name in ("A", "B") for pid in self._rank_pids_any(name)]
        peaks = [p for p in (peak_rss(pid) for pid in ranks) if p is not None]
        if not peaks:
            raise BenchmarkError(f"{self.variant}: no rank's peak RSS could be read ({ranks})")
        return Steady(
            interval=every,
            cost_s=record["cost_s"] if record else None,
            calib_step_s=record["step_s"] if record else None,
            overhead=record["overhead"] if record else None,
            chosen_at_step=record["step"] if record else None,
            first_step=first["step"],
            last_step=end["step"],
            step_s=(end["ts"] - first["ts"]) / (end["step"] - first["step"]),
            snapshot_state_bytes=end.get("snapshot_state_bytes"),
            snapshot_held_bytes=end.get("snapshot_held_bytes"),
            chain_s=median(chains) if chains else None,
            peak_rss_bytes=max(peaks),
        )

    def _rank_pids_any(self, name: str) -> list[int]:
        if self.variant == "hyperpodrun":
            return self.node_rank_pids(name)
        return list(self.rank_pids(name).values())

    def _spares(self) -> dict[str, int]:
        """Node -> pid of its latest spare rank reported ready (hyperpodrun)."""
        by_suffix = {str(node.pid): name for name, node in self.nodes.items()}
        spares = {}
        for r in self.event_log():
            if r["event"] == "spare_ready":
                name = by_suffix.get(str(r["node"]).rsplit("-", 1)[-1])
                if name is not None:
                    spares[name] = int(r["pid"])
        return spares

    def _spare_rss(self) -> int | None:
        """RSS of node A's parked spare rank (the same script, torch imported, no model state): the floor."""
        if self.variant != "hyperpodrun" or "A" not in self.nodes:
            return None
        pid = self._spares().get("A")
        return current_rss(pid) if pid is not None else None

    def _join_blocked(self) -> str | None:
        """Why a third node would not fit in memory (None: it fits): 2 more ranks at the steady peak, the
        gathered full state on the new round's rank 0 (parameters and AdamW state) and a margin."""
        assert self.steady is not None
        per_rank = self.steady.peak_rss_bytes
        full_state = (self.steady.snapshot_state_bytes or 0) * self.full_world
        need = NPROC * per_rank + full_state + MEMORY_MARGIN
        free = psutil.virtual_memory().available
        if need > free:
            return f"a third node needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
        return None

    def _leave(self, index: int, *, node: str, world: int, target: int) -> dict[str, Any]:
        ev = self._event(index, kind="leave", node=node, world=world, target=target)
        self.lost.add(node)  # exits 0 on its own: not a job death
        return ev

    def _event(self, index: int, *, kind: str, node: str, world: int, target: int) -> dict[str, Any]:
        ev = super()._event(index, kind=kind, node=node, world=world, target=target)
        hydrated = [
            r for r in self.event_log() if r["event"] == "hydrated" and r["ts"] > ev["t_event"] and "seconds" in r
        ]
        ev["hydration_s"] = max(float(r["seconds"]) for r in hydrated) if hydrated else None
        return ev

    def _failure_step(self, world: int, *, after_ts: float) -> int:
        """The step a failure falls at: the round's snapshot interval chosen (after the last event), then a
        seeded number of steps within it (at most :attr:`max_failure_wait`)."""
        record = self.wait_for_choice(
            world, after_ts=after_ts, what=f"{self.variant}: the snapshot interval at world {world} after an event"
        )
        every = int(record["every"]) if record is not None else 1
        step = self.records()[-1]["step"] + 1 + self.rng.randrange(min(every, self.max_failure_wait))
        self.wait_step(step, world=world, what=f"{self.variant}: step {step} at world {world}")
        return step

    def _failure(self, index: int, *, kind: str, step: int) -> dict[str, Any]:
        before = self.choices()
        ev = super()._failure(index, kind=kind, step=step)
        t_event = ev["t_event"]
        in_force = [r for r in before if r["ts"] <= t_event]
        ev["interval"] = int(in_force[-1]["every"]) if in_force else None
        ev["restored_from"] = restored_from(self.event_log(), t_event)
        return ev


def restored_from(log: list[dict[str, Any]], t_event: float) -> str | None:
    """Where the repair after ``t_event`` took the sharded state from: ``snapshot`` (with the steps it rolled
    back), or ``no snapshot`` (no step at which every shard survived: the checkpoint, or a fresh model)."""
    for r in log:
        if r["ts"] <= t_event:
            continue
        if r["event"] == "snapshot_restored":
            return f"snapshot, {r.get('redone')} step(s) back"
        if r["event"] == "snapshot_unavailable":
            return f"no snapshot: {r.get('reason')}"
    return None


# --------------------------------------------------------------------------- driver


def _event_of(run: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((ev for ev in run["events"] if ev["kind"] == kind and ev["outcome"] == "ok"), None)


def _get(ev: dict[str, Any] | None, key: str) -> Any:
    return None if ev is None else ev.get(key)


def measure_size(model: str, args: argparse.Namespace, kinds: Sequence[str], work: Path) -> dict[str, Any]:
    """Every measurement of one size: the hyperpodrun scenario, torchrun's steady window, the hydration bounds."""
    sys.path.insert(0, str(REPO_ROOT / "examples" / "llama_finetune"))
    from model import LlamaConfig  # the example's presets

    params = LlamaConfig.from_name(model).num_params()
    train = TrainArgs(
        steps=1_000_000,
        model=model,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        extra=("--fsdp", "--dtype", "fp32"),
    )
    # No fixed step time (the step is the model's), a hang only after HANG_TIMEOUT_S (a big state's round takes time).
    # scaling timeout: A waits for B before its first round (else A's ranks start alone and restart at once).
    # lease: an agent starved of CPU by 4-6 ranks of a big model must not be taken for a lost node.
    timers = FailureTimers(
        step_time_s=0.0,
        scaling_timeout_s=3.0,
        lease_ttl_s=LEASE_TTL_S,
        graceful_shutdown_timeout_s=GRACEFUL_TIMEOUT_S,
        hang_timeout_s=HANG_TIMEOUT_S,
        nproc_per_node=NPROC,
        max_nodes=3,
    )

    def scenario(variant: str) -> ScalingScenario:
        return ScalingScenario(
            variant,
            train,
            timers,
            work=work / variant,
            data_cache=args.out / "data-cache",
            event_timeout=args.event_timeout or EVENT_TIMEOUT_S[args.mode],
            settle_steps=SETTLE_STEPS[args.mode],
            window=WINDOW[args.mode],
            max_failure_wait=MAX_FAILURE_WAIT[args.mode],
            seed=args.seed,
        )

    print(f"{NAME}: {model} ({params / 1e6:.1f}M parameters): hyperpodrun, 2 nodes x {NPROC} ranks ...", flush=True)
    ours = scenario("hyperpodrun").run_size(kinds)
    if ours["failure"] or ours["steady"] is None:
        print(f"{NAME}: {model}: hyperpodrun stopped: {(ours['failure'] or '?').splitlines()[0]}", flush=True)
    theirs = None
    if TORCHRUN[args.mode] and args.torchrun and ours["steady"] is not None:
        print(f"{NAME}: {model}: torchrun, 2 nodes x {NPROC} ranks, steps up to {ours['steady']['last_step']} ...")
        window = (ours["steady"]["first_step"], ours["steady"]["last_step"])
        theirs = scenario("torchrun-noshare").run_size((), steady_steps=window)
    print(f"{NAME}: {model}: hydration, broadcast and memcpy of its state, 2 ranks ...", flush=True)
    bounds = hydration.measure(
        state_mb=max(1, round(params * BYTES_PER_PARAM / 2**20)),
        ranks=2,
        bucket_mb=64.0,
        reps=HYDRATION_REPS[args.mode],
        raw=work / "hydration.raw.json",
    )
    return {"model": model, "params": params, "hyperpodrun": ours, "torchrun": theirs, "hydration": bounds}


def size_result(m: dict[str, Any]) -> SizeResult:
    """The figures of one size from its measurements."""
    ours, theirs, bounds = m["hyperpodrun"], m["torchrun"], m["hydration"]
    # a run that stopped before its steady window (its failure says why) keeps what it measured: None elsewhere
    s = ours["steady"] or dict.fromkeys(Steady.__dataclass_fields__)
    state = m["params"] * BYTES_PER_PARAM // (2 * NPROC)
    join, leave = _event_of(ours, "join"), _event_of(ours, "leave")
    crash, loss = _event_of(ours, "rank_crash"), _event_of(ours, "node_loss")
    mb = bounds["nbytes"] / 1e6
    hyd, bcast, copy = (median(bounds[k]) for k in ("hydration_s", "broadcast_s", "memcpy_s"))
    their_step = theirs["steady"]["step_s"] if theirs and theirs["steady"] else None
    floor = ours["floor_rss_bytes"]
    held, local = s["snapshot_held_bytes"], s["snapshot_state_bytes"]
    return SizeResult(
        model=m["model"],
        params=m["params"],
        state_bytes_per_rank=state,
        snapshot_state_bytes=local,
        snapshot_held_bytes=held,
        snapshot_memory_ratio=held / local if held and local else None,
        snapshot_interval=s["interval"],
        snapshot_cost_s=s["cost_s"],
        snapshot_overhead=s["overhead"],
        snapshot_chain_s=s["chain_s"],
        snapshot_mb_per_s=local / s["chain_s"] / 1e6 if local and s["chain_s"] else None,
        step_s=s["step_s"],
        torchrun_step_s=their_step,
        throughput_ratio_vs_torchrun=their_step / s["step_s"] if their_step and s["step_s"] else None,
        peak_rss_bytes=s["peak_rss_bytes"],
        floor_rss_bytes=floor,
        peak_rss_over_state=s["peak_rss_bytes"] / state if s["peak_rss_bytes"] else None,
        peak_rss_less_floor_over_state=(s["peak_rss_bytes"] - floor) / state if floor and s["peak_rss_bytes"] else None,
        join_world=_get(join, "to_world"),
        join_downtime_s=_get(join, "downtime_s"),
        join_pause_s=_get(join, "pause_s"),
        join_hydration_s=_get(join, "hydration_s"),
        leave_downtime_s=_get(leave, "downtime_s"),
        leave_pause_s=_get(leave, "pause_s"),
        crash_downtime_s=_get(crash, "downtime_s"),
        crash_pause_s=_get(crash, "pause_s"),
        crash_steps_redone=_get(crash, "steps_lost"),
        crash_interval=_get(crash, "interval"),
        crash_restored_from=_get(crash, "restored_from"),
        node_loss_downtime_s=_get(loss, "downtime_s"),
        node_loss_pause_s=_get(loss, "pause_s"),
        node_loss_steps_redone=_get(loss, "steps_lost"),
        node_loss_interval=_get(loss, "interval"),
        node_loss_restored_from=_get(loss, "restored_from"),
        hydration_mb_per_s=mb / hyd,
        broadcast_mb_per_s=mb / bcast,
        memcpy_mb_per_s=mb / copy,
        hydration_over_broadcast=bcast / hyd,
        hydration_over_memcpy=copy / hyd,
        outcomes={ev["kind"]: ev["outcome"] for ev in ours["events"]}
        | ({"join": f"skipped: {ours['join_skipped']}"} if ours["join_skipped"] else {}),
        failure=ours["failure"].splitlines()[0] if ours["failure"] else None,
    )


def plot(result: BenchmarkResult, sizes: list[SizeResult], path: Path) -> None:
    """Cost against the rank's state, per event kind, with the bandwidth bounds drawn."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [s.state_bytes_per_rank / 1e6 for s in sizes]
    series = (
        ("join: survivors' pause", "join_pause_s", "o-"),
        ("leave: survivors' pause", "leave_pause_s", "v-"),
        ("rank crash: downtime", "crash_downtime_s", "s-"),
        ("node loss: downtime", "node_loss_downtime_s", "D-"),
        ("snapshot: step time it costs", "snapshot_cost_s", "^-"),
        ("snapshot: one chain", "snapshot_chain_s", "x--"),
    )
    for label, key, style in series:
        pts = [(x, getattr(s, key)) for x, s in zip(xs, sizes) if getattr(s, key)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=6)
    lo, hi = min(xs) / 1.5, max(xs) * 1.5
    for label, key, color in (("broadcast", "broadcast_mb_per_s", "k"), ("memcpy", "memcpy_mb_per_s", "0.5")):
        bw = median(getattr(s, key) for s in sizes)
        ax.plot([lo, hi], [lo / bw, hi / bw], ":", color=color, label=f"the rank's state at {label} ({bw:.0f} MB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training state per rank, MB (fp32 parameters + gradients + AdamW, world 4)")
    ax.set_ylabel("seconds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(
        f"{result.name} ({result.mode}): 2 nodes x {NPROC} ranks, FSDP2 on gloo, "
        f"{result.machine['usable_cpus']} CPU cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--sizes",
            type=lambda s: tuple(s.split(",")),
            default=None,
            help=f"model presets, smallest first (default: {', '.join(SIZES['quick'])}; full adds "
            f"{SIZES['full'][-1]}; smoke: tiny)",
        )
        parser.add_argument(
            "--kinds",
            type=lambda s: tuple(s.split(",")),
            default=None,
            help=f"events, from {', '.join(KINDS)} (default: all; smoke: rank_crash, node_loss)",
        )
        parser.add_argument("--no-torchrun", dest="torchrun", action="store_false", help="skip the torchrun baseline")
        parser.add_argument("--seq-len", type=int, default=32, help="tokens per sample [32]")
        parser.add_argument("--global-batch", type=int, default=6, help="samples per step (6: world 6 fits) [6]")
        parser.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch [2]")
        parser.add_argument("--seed", type=int, default=0, help="seed of the failure steps [0]")
        parser.add_argument("--event-timeout", type=float, default=None, help="hard limit per wait, s")

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    sys.path.insert(0, str(REPO_ROOT / "examples" / "llama_finetune"))
    from model import PRESETS

    sizes = args.sizes or SIZES[args.mode]
    kinds = args.kinds or DEFAULT_KINDS[args.mode]
    for size in sizes:
        if size not in PRESETS:
            raise SystemExit(f"--sizes: unknown preset {size!r}; choose from {', '.join(PRESETS)}")
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"--kinds: unknown event {kind!r}; choose from {', '.join(KINDS)}")
    if "leave" in kinds and "join" not in kinds:
        raise SystemExit("--kinds: leave needs join (the node that joined is the one that leaves)")
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "sizes": list(sizes),
            "kinds": list(kinds),
            "nodes": 2,
            "nproc_per_node": NPROC,
            "train": {"seq_len": args.seq_len, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
            "train_flags": "--fsdp --dtype fp32 (hyperpodrun: --snapshot-every auto, the default)",
            "window_steps": WINDOW[args.mode],
            "max_failure_wait_steps": MAX_FAILURE_WAIT[args.mode],
            "seed": args.seed,
            "torchrun": bool(TORCHRUN[args.mode] and args.torchrun),
            "bytes_per_param": BYTES_PER_PARAM,
        },
        baseline="torchrun --nnodes 1:3 (c10d, no shared store) on the same 2 x 2 and steps; a plain dist.broadcast "
        "and a memcpy of the same bytes on a gloo group of 2 (hydration.measure), in the same run",
    )
    work = args.out / "work" / NAME
    shutil.rmtree(work, ignore_errors=True)
    measured, results = [], []
    for size in sizes:
        m = measure_size(size, args, kinds, work / size)
        measured.append(m)
        results.append(size_result(m))
        print(format_table(["figure", "value"], [(k, v) for k, v in dataclasses.asdict(results[-1]).items()]))
    result.samples["sizes"] = measured
    result.summary = {
        "sizes": [dataclasses.asdict(r) for r in results],
        "targets": TARGETS,
        "joined_3x2": [r.model for r in results if r.join_world == 3 * NPROC],
    }
    result.notes += [
        "Every node, rank and baseline shares this machine's 2 CPU cores: 4 to 6 ranks (and 2 parked spares) "
        "oversubscribe them, so step times and downtimes hold scheduling delays a real node would not have; "
        "loopback gloo moves bytes through memory, so the bandwidths are memory bandwidths shared with compute.",
        "state_bytes_per_rank is the rank's share at world 4 of 16 bytes a parameter (fp32 weights, gradients, "
        "AdamW's two moments); snapshot_state_bytes is what a snapshot copies (weights and AdamW state, measured); "
        "peak_rss_over_state includes the process floor (Python, torch, gloo: floor_rss_bytes, a parked spare "
        "rank's RSS), which dominates at small sizes.",
        "snapshot_overhead is the round's own measurement (cost of one snapshot over interval x step, from the "
        "steps it timed with and without one); throughput_ratio_vs_torchrun is torchrun's mean step time over "
        "ours on the same steps (one run each in quick mode: no confidence interval).",
        "hydration_over_broadcast is hydration.py's path (parameters and AdamW state of a replicated model "
        "of as many parameters, in buckets) against one dist.broadcast of the same bytes on the same 2-rank gloo "
        "group, and memcpy one copy of them; join_hydration_s is the in-job hydration of the sharded model "
        "(its full state gathered onto the new rank 0, then each rank's shards).",
        "A failure falls at a seeded step within the interval chosen by the round before it (at most "
        f"{MAX_FAILURE_WAIT[args.mode]} steps after the choice); its steps redone are read from rank 0's log.",
    ]
    plot(result, results, result.plot_path(args.out))
    path = result.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
