"""The elastic demo: one fine-tuning job that grows and shrinks on this machine, no server needed.

    python examples/llama_finetune/demo.py                 # or: make demo   (1-4 minutes on 2 cores, depending on load)
    python examples/llama_finetune/demo.py --steps 60 --schedule join:node-2@10,leave:node-2@30

The first ``hyperpodrun`` launcher (``node-1``) starts the tiny Llama fine-tune and hosts
the embedded rendezvous store; launchers ``node-2`` and ``node-3`` join later, and one of
them is then stopped with SIGTERM (a graceful leave). Each launcher is one "node" of one
rank, so the data-parallel world goes 1 -> 2 -> 3 -> 2 while the global batch, the
learning rate and the loss curve carry on. A status line per second shows the elapsed
time, world size, step and loss (read from the trainer's metrics file and the job's event
log); the summary at the end lists the world sizes over time, each scale event with its
downtime (from the event log), the exactly-once check of the samples (from the sample log
against the epoch permutation) and the loss. Exit status 0 when every check passed.

Everything is written to ``--run-dir`` (default: a new temporary folder): the launchers'
logs ``node-*.log``, ``events.jsonl``, ``metrics.jsonl``, ``samples.jsonl``, checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TextIO

import torch
from train import Runtime, TrainConfig, prepare_dataset

from elastic_events import contract
from elastic_events.data.dataset import ByteTokenizer
from elastic_events.data.sampler import epoch_permutation
from hyperpodrun.device_plan import DevicePlan

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
STORE_HOST = "node-1"  # the first launcher hosts the embedded store: the job cannot outlive it
SCALING_TIMEOUT_S = 2.0  # seconds a new launcher waits as a standby before the job grows
MAX_NODES = 3  # --nnodes 1:3, one rank each
_LAUNCHER_ENV_PREFIXES = ("PET_", "TORCHELASTIC_", contract.ENV_PREFIX)


class DemoError(RuntimeError):
    """The demo could not run (bad schedule, a launcher failed to start, a timeout)."""


# ------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Change:
    """Start (``join``) or SIGTERM (``leave``) one launcher once training reached ``at_step``."""

    at_step: int
    action: Literal["join", "leave"]
    node: str

    def __post_init__(self) -> None:
        if self.action not in ("join", "leave"):
            raise DemoError(f"schedule: action must be join or leave, got {self.action!r}")
        if isinstance(self.at_step, bool) or not isinstance(self.at_step, int) or self.at_step < 1:
            raise DemoError(f"schedule: at_step must be an integer >= 1, got {self.at_step!r}")
        if not self.node or not self.node.replace("-", "").isalnum():
            raise DemoError(f"schedule: node must be a plain name like node-2, got {self.node!r}")

    @classmethod
    def parse(cls, text: str) -> Change:
        """``join:node-2@10`` -> Change(at_step=10, action="join", node="node-2")."""
        try:
            action, rest = text.split(":", 1)
            node, at = rest.split("@", 1)
            return cls(at_step=int(at), action=action, node=node)  # type: ignore[arg-type]
        except ValueError:
            raise DemoError(f"schedule entry {text!r}: expected ACTION:NODE@STEP, e.g. join:node-2@10") from None


DEFAULT_SCHEDULE = (
    Change(at_step=25, action="join", node="node-2"),
    Change(at_step=70, action="join", node="node-3"),
    Change(at_step=120, action="leave", node="node-2"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run. The world sizes it expects follow from ``schedule`` (1 rank per launcher)."""

    run_dir: Path
    steps: int = 200
    schedule: tuple[Change, ...] = DEFAULT_SCHEDULE
    global_batch: int = 8
    micro_batch: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 10
    seed: int = 0
    num_workers: int = 1
    min_step_time: float = 0.0
    ckpt_every: int = 50
    train_args: tuple[str, ...] = ()  # more train.py flags (e.g. --save-final PATH)
    timeout_s: float = 600.0
    status_every_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DemoError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("timeout_s", "status_every_s"):
            if not getattr(self, name) > 0:
                raise DemoError(f"{name} must be > 0, got {getattr(self, name)!r}")
        running, previous = {STORE_HOST}, 0
        for change in self.schedule:
            if change.at_step <= previous or change.at_step >= self.steps:
                raise DemoError(
                    f"schedule: {change.action} {change.node} at step {change.at_step} must come after step "
                    f"{previous} and before the last step {self.steps}"
                )
            previous = change.at_step
            if change.action == "join" and change.node in running | {STORE_HOST}:
                raise DemoError(f"schedule: {change.node} joins twice (node names are used once)")
            if change.action == "leave" and change.node == STORE_HOST:
                raise DemoError(f"schedule: {STORE_HOST} hosts the rendezvous store and must stay to the end")
            if change.action == "leave" and change.node not in running:
                raise DemoError(f"schedule: {change.node} leaves but is not running")
            (running.add if change.action == "join" else running.discard)(change.node)
            if len(running) > self.global_batch:
                raise DemoError(f"schedule: {len(running)} ranks exceed the global batch of {self.global_batch}")

    def expected_world_sizes(self) -> tuple[int, ...]:
        sizes = [1]
        for change in self.schedule:
            sizes.append(sizes[-1] + (1 if change.action == "join" else -1))
        return tuple(sizes)

    @property
    def data_cache(self) -> Path:
        return self.run_dir / "data"

    def train_command(self) -> list[str]:
        d = self.run_dir
        args = {
            "--steps": self.steps,
            "--global-batch": self.global_batch,
            "--micro-batch": self.micro_batch,
            "--seq-len": self.seq_len,
            "--lr": self.lr,
            "--warmup-steps": self.warmup_steps,
            "--seed": self.seed,
            "--num-workers": self.num_workers,
            "--min-step-time": self.min_step_time,
            "--ckpt-every": self.ckpt_every,
            "--log-every": 1,
            "--data-cache": self.data_cache,
            "--run-dir": d,
            "--metrics": d / "metrics.jsonl",
            "--sample-log": d / "samples.jsonl",
        }
        return [str(TRAIN_SCRIPT), *(str(x) for kv in args.items() for x in kv), *self.train_args]


# --------------------------------------------------------------------------- summary


@dataclasses.dataclass(frozen=True, kw_only=True)
class Round:
    round: int
    world_size: int
    started_s: float  # since the demo started
    first_step: int | None
    last_step: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleEvent:
    """One change of world size, with its downtime split into phases (seconds)."""

    from_world: int
    to_world: int
    at_step: int | None
    reason: str
    mode: str  # "in place" (ranks reconfigured, newcomers hydrated from peers) or "restart" (save, restart, load)
    downtime_s: float | None  # end of the last step at the old size -> end of the first at the new size
    pause_s: float | None  # the downtime less one normal step: the time no rank trained
    phases: dict[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    run_dir: Path
    rounds: tuple[Round, ...]
    scale_events: tuple[ScaleEvent, ...]
    steps_trained: int
    samples_seen: int
    exactly_once: bool  # the sample log matches the epoch permutation, step by step
    first_loss: float | None
    final_loss: float | None
    exit_codes: dict[str, int | None]
    elapsed_s: float
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(r.world_size for r in self.rounds)

    def to_json(self) -> dict[str, Any]:
        return {**json.loads(json.dumps(dataclasses.asdict(self), default=str)), "ok": self.ok}

    def render(self) -> str:
        lines = [f"Elastic demo summary ({self.run_dir})", "  world sizes over time:"]
        for r in self.rounds:
            steps = f"steps {r.first_step}-{r.last_step}" if r.first_step is not None else "no step"
            lines.append(f"    round {r.round:<3d} world {r.world_size}   from {r.started_s:6.1f}s   {steps}")
        lines.append("  scale events (downtime: last step at the old size -> first step at the new size):")
        for e in self.scale_events:
            phases = ", ".join(f"{k} {v:.1f}s" for k, v in e.phases.items())
            downtime = f"{e.downtime_s:.1f}s" if e.downtime_s is not None else "unknown"
            pause = f", survivors paused {e.pause_s:.1f}s" if e.pause_s is not None else ""
            lines.append(
                f"    {e.from_world} -> {e.to_world} after step {e.at_step}, {e.mode}: downtime {downtime}{pause} ({phases})"
            )
            lines.append(f"        why: {e.reason}")
        verdict = "each seen exactly once" if self.exactly_once else "NOT exactly once"
        lines.append(f"  data: {self.samples_seen} samples in {self.steps_trained} steps, {verdict} (sample log)")
        if self.first_loss is not None and self.final_loss is not None:
            lines.append(f"  loss: {self.first_loss:.3f} (first step) -> {self.final_loss:.3f} (last step)")
        codes = ", ".join(f"{name} exit {code}" for name, code in self.exit_codes.items())
        lines.append(f"  launchers: {codes}")
        lines.append(f"  elapsed: {self.elapsed_s:.0f}s")
        if self.ok:
            lines.append("  OK: every check passed")
        else:
            lines.extend(["  FAILED:", *(f"    - {p}" for p in self.problems)])
        return "\n".join(lines)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_samples(
    records: Iterable[dict[str, Any]], *, num_samples: int, global_batch: int, seed: int, steps: int
) -> list[str]:
    """Problems with the sample log: every step 1..steps trained once by each rank of its world,
    on exactly the step's global batch of the epoch permutation (so nothing repeated or skipped)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    problems = []
    if sorted(by_step) != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(by_step))
        extra = sorted(set(by_step) - set(range(1, steps + 1)))
        problems.append(f"sample log: steps missing {missing[:10]}, unexpected {extra[:10]}")
    steps_per_epoch = num_samples // global_batch
    for step, recs in sorted(by_step.items()):
        world = recs[0]["world_size"]
        ranks = sorted(r["rank"] for r in recs)
        if ranks != list(range(world)):
            problems.append(f"step {step}: logged by ranks {ranks} of a world of {world} (a step trained twice?)")
            continue
        ids = [i for r in recs for i in r["sample_ids"]]
        epoch, position = divmod((step - 1) * global_batch, steps_per_epoch * global_batch)
        expected = epoch_permutation(num_samples, seed=seed, epoch=epoch)[position : position + global_batch].tolist()
        if sorted(ids) != sorted(expected):
            problems.append(f"step {step}: trained samples {sorted(ids)[:8]}..., expected {sorted(expected)[:8]}...")
    return problems


def _records(events: list[dict[str, Any]], kind: str, rnd: int) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind and e["round"] == rnd]


def _segments(metrics: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rank 0's step records (one per step) split where the world size changes."""
    segments: list[list[dict[str, Any]]] = []
    for m in sorted(metrics, key=lambda m: m["step"]):
        if not segments or segments[-1][-1]["world_size"] != m["world_size"]:
            segments.append([])
        segments[-1].append(m)
    return segments


def _step_interval(records: list[dict[str, Any]], last: int = 5) -> float | None:
    """The median time between the last ``last`` consecutive steps of ``records``."""
    tail = records[-last:]
    gaps = sorted(b["ts"] - a["ts"] for a, b in zip(tail, tail[1:]) if b["step"] == a["step"] + 1)
    return gaps[len(gaps) // 2] if gaps else None


def _scale_event(
    old: list[dict[str, Any]], new: list[dict[str, Any]], events: list[dict[str, Any]], names: Callable[[str], str]
) -> tuple[ScaleEvent, str | None]:
    """The change between two runs of steps at different world sizes, as the benchmarks measure it: from the end
    of the last step at the old size to the end of the first at the new one, split at the trainer's and agents'
    records in between; the survivors' pause is that less one normal step (the one trained in it)."""
    last, first = old[-1], new[0]
    window = [e for e in events if last["ts"] <= e["ts"] <= first["ts"]]
    decided = [e for e in events if e["event"] == "scale_decided" and e["ts"] <= first["ts"]]

    def mark(kind: str) -> float | None:
        return min((e["ts"] for e in window if e["event"] == kind), default=None)

    in_place = mark("group_torn_down") is not None
    if in_place:  # ranks kept their processes: the trainer's records of the reconfiguration
        marks = {
            "group torn down": mark("group_torn_down"),
            "rendezvous + group up": mark("group_up"),
            "hydrated": mark("hydrated"),
            "first step": first["ts"],
        }
    else:
        marks = {
            "save": mark("checkpoint_saved"),
            "stop + rendezvous": mark("rendezvous_done"),
            "start + load": mark("checkpoint_loaded"),
            "first step": first["ts"],
        }
    phases: dict[str, float] = {}
    problem = None
    lacking = [name for name, ts in marks.items() if ts is None]
    if lacking:
        problem = (
            f"world {last['world_size']} -> {first['world_size']}: the logs lack the {', '.join(lacking)} record(s)"
        )
    else:
        previous = last["ts"]
        for name, ts in marks.items():
            phases[name], previous = ts - previous, ts
    downtime = first["ts"] - last["ts"]
    interval = _step_interval(old)
    event = ScaleEvent(
        from_world=last["world_size"],
        to_world=first["world_size"],
        at_step=last["step"],
        reason=names(decided[-1].get("reason", "")) if decided else "",
        mode="in place" if in_place else "restart",
        downtime_s=downtime,
        pause_s=None if interval is None else max(0.0, downtime - interval),
        phases=phases,
    )
    return event, problem


def summarize(
    config: DemoConfig,
    *,
    num_samples: int,
    started: float,
    exit_codes: dict[str, int | None],
    problems: list[str],
    names: Callable[[str], str] = lambda text: text,
) -> Summary:
    """Read the event, metrics and sample logs of a finished run and check them.

    Downtime of a scale event: from the end of the last step at the old size to the end of the first
    step at the new size (rank 0's metrics record of every step), split at the trainer's and agents'
    records in between; the survivors' pause is the downtime less one normal step.
    """
    events = read_jsonl(config.run_dir / "events.jsonl")
    metrics = read_jsonl(config.run_dir / "metrics.jsonl")
    problems = list(problems)
    segments = _segments(metrics)  # steps at one world size; a change between two is a scale event
    rounds = []
    for seg in segments:
        begun = [
            e["round"]
            for e in events
            if e["event"] in ("rendezvous_done", "group_torn_down") and e["ts"] <= seg[0]["ts"]
        ]
        rounds.append(
            Round(
                round=max(begun, default=0),
                world_size=seg[0]["world_size"],
                started_s=seg[0]["ts"] - started,
                first_step=seg[0]["step"],
                last_step=seg[-1]["step"],
            )
        )
    scale_events = []
    for old, new in zip(segments, segments[1:], strict=False):
        event, problem = _scale_event(old, new, events, names)
        scale_events.append(event)
        problems += [problem] if problem else []
    world_sizes = tuple(r.world_size for r in rounds)
    if world_sizes != config.expected_world_sizes():
        problems.append(
            f"world sizes over time were {world_sizes}, the schedule expects {config.expected_world_sizes()}"
        )
    if not any(e["event"] == "job_succeeded" for e in events):
        problems.append("the event log has no job_succeeded record")
    samples = read_jsonl(config.run_dir / "samples.jsonl")
    sample_problems = check_samples(
        samples, num_samples=num_samples, global_batch=config.global_batch, seed=config.seed, steps=config.steps
    )
    problems += sample_problems
    losses = {m["step"]: m["loss"] for m in metrics}
    first_loss, final_loss = losses.get(1), losses.get(config.steps)
    if first_loss is None or final_loss is None:
        problems.append(f"metrics lack the loss of step 1 or step {config.steps}")
    elif not final_loss < first_loss:
        problems.append(f"the loss did not fall: {first_loss:.3f} at step 1, {final_loss:.3f} at step {config.steps}")
    for name, code in exit_codes.items():
        if code != 0:
            problems.append(f"launcher {name} exited with {code} (log: {config.run_dir / f'{name}.log'})")
    return Summary(
        run_dir=config.run_dir,
        rounds=tuple(rounds),
        scale_events=tuple(scale_events),
        steps_trained=len({s["step"] for s in samples}),
        samples_seen=sum(len(s["sample_ids"]) for s in samples),
        exactly_once=not sample_problems,
        first_loss=first_loss,
        final_loss=final_loss,
        exit_codes=exit_codes,
        elapsed_s=time.time() - started,
        problems=tuple(problems),
    )


# ---------------------------------------------------------------------------- running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tail:
    """New complete lines of a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class _Launchers:
    """The demo's hyperpodrun processes, one per node; every one is ended by its pid."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        port = _free_port()
        d = config.run_dir
        self.flags = [
            "--nnodes",
            f"1:{MAX_NODES}",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"demo-{port}",
            "--rdzv-conf",
            "lease_ttl=3",
            "--scaling-timeout",
            str(SCALING_TIMEOUT_S),
            "--min-stable-period",
            "2",
            "--faulty-scale-down-timeout",
            "5",
            "--graceful-shutdown-timeout",
            "60",
            "--monitor-interval",
            "0.1",
            "--event-log",
            str(d / "events.jsonl"),
            "--log-dir",
            str(d / "logs"),
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.devices = DevicePlan.for_host(slots=MAX_NODES, nproc=1)  # a GPU per node, or every node on the CPU
        self.slots: dict[str, int] = {}
        if (note := self.devices.note()) is not None:
            print(f"demo: {note}", flush=True)

    def start(self, name: str) -> None:
        taken = {slot for n, slot in self.slots.items() if self.procs[n].poll() is None}
        self.slots[name] = min(set(range(MAX_NODES)) - taken)
        env = {**self.env, **self.devices.env(self.slots[name])}
        with open(self.config.run_dir / f"{name}.log", "wb") as log:
            cmd = [sys.executable, "-m", "hyperpodrun", *self.flags, *self.config.train_command()]
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def names(self, text: str) -> str:
        """``text`` with hyperpodrun's node ids (``<host>-<launcher pid>``) replaced by the demo's names."""
        for name, proc in self.procs.items():
            text = text.replace(f"{socket.gethostname()}-{proc.pid}", name)
        return text

    def leave(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGTERM)  # graceful: the job shrinks at the next agreed step

    def failed(self) -> str | None:
        """Why the job cannot go on: a launcher exited non-zero (None while all run or exited 0)."""
        for name, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                return f"launcher {name} exited with {proc.returncode}; see {self.config.run_dir / f'{name}.log'}"
        return None

    def finished(self) -> bool:
        return self.procs[STORE_HOST].poll() is not None

    def wait_all(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: proc.poll() for name, proc in self.procs.items()}

    def stop_all(self, grace: float = 30.0) -> None:
        """SIGINT (stop the ranks, no graceful leave) to each launcher still running, then SIGKILL."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGINT)
        for proc in running:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=grace)


def _describe(event: dict[str, Any], names: Callable[[str], str]) -> str | None:
    """The progress display's line for a notable record of the event log."""
    if event["event"] == "scale_decided":
        return f"scale event decided: {names(event.get('reason', ''))}"
    if event["event"] == "rendezvous_done":
        return f"round {event['round']}: world size {event['world_size']}"
    if event["event"] == "first_step" and event["round"] > 1:
        return f"training again, at world size {event['world_size']}"
    return None


def run_demo(config: DemoConfig, *, out: TextIO = sys.stdout, clock: Callable[[], float] = time.monotonic) -> Summary:
    """Run the scenario of ``config`` to its end; return the checked summary (``summary.ok``)."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    tty = out.isatty()
    started, t0 = time.time(), clock()

    def note(message: str) -> None:
        out.write(("\r\033[K" if tty else "") + f"[{clock() - t0:6.1f}s] {message}\n")
        out.flush()

    # Tokenise before any launcher starts, so the job's first round does not pay for it.
    tokens = TrainConfig(data_cache=config.data_cache, seq_len=config.seq_len, num_workers=0)
    rt = Runtime(
        rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), compute_dtype=torch.float32, distributed=False
    )
    num_samples = len(prepare_dataset(tokens, ByteTokenizer(), rt))

    launchers = _Launchers(config)
    metrics, events = _Tail(config.run_dir / "metrics.jsonl"), _Tail(config.run_dir / "events.jsonl")
    pending = list(config.schedule)
    expected_world, step, loss, world = 1, 0, float("nan"), 0
    problems: list[str] = []
    seen_rounds: set[int] = set()
    try:
        launchers.start(STORE_HOST)
        note(
            f"started {STORE_HOST} (hosts the rendezvous store); {config.steps} steps of {config.global_batch} samples"
        )
        next_status = clock()
        while not launchers.finished():
            for m in metrics.read():
                step, loss, world = m["step"], m["loss"], m["world_size"]
            for e in events.read():
                if e["event"] == "rendezvous_done":
                    if e["round"] in seen_rounds:
                        continue  # every launcher logs each round it joins
                    seen_rounds.add(e["round"])
                if message := _describe(e, launchers.names):
                    note(message)
            if pending and step >= pending[0].at_step and world == expected_world:
                change = pending.pop(0)
                if change.action == "join":
                    launchers.start(change.node)
                    note(f"started {change.node}: it joins after the scaling timeout ({SCALING_TIMEOUT_S:g}s)")
                else:
                    launchers.leave(change.node)
                    note(f"SIGTERM to {change.node}: it leaves at the next agreed step")
                expected_world += 1 if change.action == "join" else -1
            if failure := launchers.failed():
                raise DemoError(failure)
            if clock() - t0 > config.timeout_s:
                raise DemoError(
                    f"the job did not finish within {config.timeout_s:g}s (at step {step} of {config.steps})"
                )
            if clock() >= next_status:
                next_status = max(next_status + config.status_every_s, clock())
                if step == 0:
                    status = f"[{clock() - t0:6.1f}s] starting: no step has run yet (first launch imports torch and builds the data cache)"
                else:
                    status = f"[{clock() - t0:6.1f}s] world {world} | step {step}/{config.steps} | loss {loss:.3f}"
                out.write(f"\r\033[K{status}" if tty else status + "\n")
                out.flush()
            time.sleep(0.1)
        exit_codes = launchers.wait_all(timeout=60.0)
        note(f"job finished: {', '.join(f'{n} exit {c}' for n, c in exit_codes.items())}")
    except DemoError as exc:
        problems.append(str(exc))
        launchers.stop_all()
        exit_codes = {name: proc.poll() for name, proc in launchers.procs.items()}
    except BaseException:
        launchers.stop_all()
        raise
    if pending:
        problems.append(
            f"the job ended before the schedule's {pending[0].action} of {pending[0].node} at step {pending[0].at_step}"
        )
    summary = summarize(
        config,
        num_samples=num_samples,
        started=started,
        exit_codes=exit_codes,
        problems=problems,
        names=launchers.names,
    )
    (config.run_dir / "summary.json").write_text(json.dumps(summary.to_json(), indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, help="where everything is written (default: a new temporary folder)")
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument(
        "--schedule",
        help="comma-separated ACTION:NODE@STEP, default "
        + ",".join(f"{c.action}:{c.node}@{c.at_step}" for c in DEFAULT_SCHEDULE),
    )
    p.add_argument("--min-step-time", type=float, default=0.0, help="pad every step to this many seconds")
    p.add_argument("--timeout", type=float, default=DemoConfig.timeout_s, help="give up after this many seconds")
    args = p.parse_args(argv)
    try:
        schedule = tuple(Change.parse(x) for x in args.schedule.split(",")) if args.schedule else DEFAULT_SCHEDULE
        run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="hyperpodrun-demo-"))
        config = DemoConfig(
            run_dir=run_dir,
            steps=args.steps,
            schedule=schedule,
            min_step_time=args.min_step_time,
            timeout_s=args.timeout,
        )
        summary = run_demo(config)
    except DemoError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    print(summary.render())
    if not summary.ok:
        print(f"demo: {len(summary.problems)} check(s) failed; logs in {summary.run_dir}", file=sys.stderr)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
