"""Shared plumbing of the benchmarks: options, statistics, results, plots and child processes.

Every benchmark is a script with the same command line (:func:`parse_args`)::

    python benchmarks/<name>.py            # full run, for publication
    python benchmarks/<name>.py --quick    # about a minute or a few, for a developer
    python benchmarks/<name>.py --smoke    # seconds: the CI test that keeps the script working
    python benchmarks/<name>.py --out DIR  # where <name>_<mode>.json and .png go

and writes one :class:`BenchmarkResult`: the machine and versions it ran on, its
parameters, the raw samples, the summary (medians, p99, ratios to the baseline measured
in the same run) and free-text notes about what limits the numbers. Beside the full
result, ``<out>/summary/<name>_<mode>.json`` holds the same without the raw samples: the
small file kept in git under ``benchmarks/results/summary/``, from which ``report.py``
renders the figures of ``benchmarks/README.md``.

Child processes (launchers, trainers, store servers) run as :class:`ManagedProcess`: in a
session of their own, with every output line timestamped on arrival, a hard deadline, and
the whole process tree killed when they are done with.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from elastic_events import contract
from hyperpodrun.rendezvous.ports import PortReservation

__all__ = [
    "LAUNCHERS",
    "MODES",
    "REPO_ROOT",
    "RESULTS_DIR",
    "SUMMARY_SUBDIR",
    "TRAIN_SCRIPT",
    "BenchmarkError",
    "BenchmarkResult",
    "BenchmarkTimeoutError",
    "Completed",
    "CpuSample",
    "ManagedProcess",
    "OutputBus",
    "OutputLine",
    "TrainArgs",
    "add_train_arguments",
    "bench_env",
    "format_table",
    "first_record_ts",
    "free_port",
    "hyperpodrun_cmd",
    "kill_tree",
    "machine_info",
    "median",
    "parse_args",
    "percentile",
    "pyplot",
    "ratio_ci",
    "read_metrics",
    "require_train_script",
    "result_tag",
    "run_rank_workers",
    "run_to_completion",
    "run_training",
    "single_node_cmd",
    "start_etcd",
    "summarize",
    "torchrun_cmd",
    "version_info",
    "wall_tokens_per_s",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
#: Under a result directory: the summaries without raw samples (kept in git for ``RESULTS_DIR``).
SUMMARY_SUBDIR = "summary"
TRAIN_SCRIPT = REPO_ROOT / "examples" / "llama_finetune" / "train.py"
#: ``smoke``: seconds, for CI; ``quick``: about a minute or a few; ``full``: for publication.
MODES = ("smoke", "quick", "full")
_SCHEMA = 1


# --------------------------------------------------------------------------- errors


class BenchmarkError(RuntimeError):
    """A benchmark could not produce its measurement."""


class BenchmarkTimeoutError(BenchmarkError, TimeoutError):
    """Something a benchmark waited for did not happen in time; the message names it."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} did not happen within {timeout:g}s")
        self.what = what
        self.timeout = timeout


# --------------------------------------------------------------------------- options


def parse_args(
    description: str,
    *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """The common options plus the benchmark's own; ``ns.mode`` is one of :data:`MODES`."""
    parser = argparse.ArgumentParser(description=description)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a short run (about a minute or a few)")
    size.add_argument("--smoke", action="store_true", help="the smallest run that exercises every path (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"result directory (default {RESULTS_DIR})")
    parser.add_argument(
        "--tag",
        default="",
        help="names this configuration in the result files, <name>_<tag>_<mode>.json (default: fsdp or hsdp "
        "with --train-args=--fsdp or --hsdp, else none)",
    )
    if add_arguments is not None:
        add_arguments(parser)
    ns = parser.parse_args(argv)
    ns.mode = "smoke" if ns.smoke else "quick" if ns.quick else "full"
    return ns


# --------------------------------------------------------------------------- statistics


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Iterable[float]) -> dict[str, float | int]:
    """``n``, ``median``, ``p99``, ``min``, ``max`` and ``mean`` of a sample."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("summarize needs at least one value")
    return {
        "n": len(data),
        "median": median(data),
        "p99": percentile(data, 99.0),
        "min": min(data),
        "max": max(data),
        "mean": sum(data) / len(data),
    }


# --------------------------------------------------------------------------- machine


#: Two-sided 95 % quantiles of Student's t by degrees of freedom (1 .. 30; normal beyond).
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def ratio_ci(ratios: Sequence[float]) -> dict[str, float | int]:
    """Geometric mean of paired ratios with its 95 % confidence interval (t on the log ratios).

    Each ratio compares two measurements taken next to each other (interleaved runs), so
    slow drifts of a shared machine cancel within a pair; the interval says how well the
    pairs pin the ratio down (``half_width_pct``: half its width, in percent of the mean).
    """
    if len(ratios) < 2 or min(ratios) <= 0:
        raise ValueError(f"ratio_ci needs at least 2 positive ratios, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return {
        "n": n,
        "ratio": math.exp(mean),
        "ci_low": math.exp(mean - half),
        "ci_high": math.exp(mean + half),
        "half_width_pct": 100.0 * (math.exp(half) - 1.0),
    }


def _run_text(cmd: Sequence[str], timeout: float = 10.0) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout or done.stderr).strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (no host names: results get published)."""
    import psutil

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_1m": os.getloadavg()[0],
        "gpus": [],
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


#: What a result's code is: the library, the benchmarks and the example they run (not docs, results, or
#: report*.py, which render results and measure nothing).
_CODE_PATHS = (
    "src",
    "benchmarks",
    "examples",
    ":(exclude)*.md",
    ":(exclude)benchmarks/results",
    ":(exclude,glob)benchmarks/report*.py",
)


def _dirty_code() -> list[str] | None:
    """Tracked files of the measured code that differ from the commit, sorted; None when git cannot say."""
    cmd = ["git", "status", "--porcelain", "--untracked-files=no", "--", *_CODE_PATHS]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10.0, check=True, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted(line[3:] for line in done.stdout.splitlines() if len(line) > 3)


def version_info() -> dict[str, Any]:
    versions: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "hyperpodrun", "numpy"):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "?")
        except ImportError:
            versions[name] = None
    try:
        import torch

        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except ImportError:
        pass
    versions["git_commit"] = _run_text(["git", "rev-parse", "--short", "HEAD"]) or None
    versions["git_dirty"] = _dirty_code() if versions["git_commit"] else None
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    if os.access(etcd, os.X_OK):
        first = _run_text([etcd, "--version"]).splitlines()
        versions["etcd"] = first[0].split(":", 1)[-1].strip() if first else None
    return versions


# --------------------------------------------------------------------------- results


#: The machine fields a summary file keeps: what a reader needs to judge its figures.
_SUMMARY_MACHINE = ("cpu", "logical_cpus", "usable_cpus", "memory_gib", "gpus", "loadavg_1m", "loadavg_1m_end")


@dataclasses.dataclass(kw_only=True)
class BenchmarkResult:
    """One run of one benchmark, written as ``<out>/<stem>.json`` (+ ``.png``) and ``<out>/summary/<stem>.json``.

    The stem is ``<name>_<mode>``, or ``<name>_<tag>_<mode>`` for a tagged configuration (e.g.
    ``failures_fsdp_quick``). ``samples`` holds raw measurements, ``summary`` what a reader
    compares (medians, p99, ratios to the baseline), ``baseline`` says what was measured
    against, ``notes`` what limits the figures on this machine. The summary file is the
    result without ``samples`` and with the machine in short.
    """

    name: str
    mode: str
    params: dict[str, Any]
    baseline: str
    tag: str = ""
    samples: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    started_at: float = dataclasses.field(default_factory=time.time)
    machine: dict[str, Any] = dataclasses.field(default_factory=machine_info)
    #: Taken when the run starts: the commit and local changes of the code that ran, not of a later checkout.
    versions: dict[str, Any] = dataclasses.field(default_factory=version_info)
    #: How the run was started: the script (relative to the repository) and its arguments.
    command: str = dataclasses.field(default_factory=lambda: _command_line(sys.argv))

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"name must be a non-empty identifier, got {self.name!r}")
        if self.tag and not self.tag.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"tag must be letters, digits, '-' and '_', got {self.tag!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.baseline:
            raise ValueError("baseline must say what the measurement is compared against")

    def stem(self) -> str:
        return f"{self.name}_{self.tag}_{self.mode}" if self.tag else f"{self.name}_{self.mode}"

    def to_json(self) -> dict[str, Any]:
        finished = time.time()
        load_end = os.getloadavg()[0]
        notes = list(self.notes)
        busiest = max(load_end, self.machine["loadavg_1m"])
        if busiest > self.machine["usable_cpus"]:
            notes.append(
                f"The machine was busy during this run (1-minute load average up to {busiest:.1f} on "
                f"{self.machine['usable_cpus']} usable CPUs, other work included): expect noisy timings."
            )
        return {
            "schema": _SCHEMA,
            "benchmark": self.name,
            "tag": self.tag or None,
            "mode": self.mode,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(finished),
            "duration_s": round(finished - self.started_at, 3),
            "machine": {**self.machine, "loadavg_1m_end": load_end},
            "versions": self.versions,
            "command": self.command,
            "params": self.params,
            "baseline": self.baseline,
            "summary": self.summary,
            "samples": self.samples,
            "notes": notes,
            "plot": f"{self.stem()}.png",
        }

    def write(self, out_dir: Path) -> Path:
        """Write the full JSON and its summary file (each atomically); returns the full JSON's path."""
        full = self.to_json()
        path = out_dir / f"{self.stem()}.json"
        _write_json(path, full)
        _write_json(out_dir / SUMMARY_SUBDIR / path.name, summary_of(full, full_result=path.name))
        return path

    def plot_path(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir / f"{self.stem()}.png"


def summary_of(full: Mapping[str, Any], *, full_result: str) -> dict[str, Any]:
    """The summary file of a full result: everything but the raw samples and the plot, the machine in short.

    ``full_result`` names the full JSON beside it (not kept in git), where the samples are.
    """
    out: dict[str, Any] = {}
    for key, value in full.items():
        if key == "machine":
            value = {k: value[k] for k in _SUMMARY_MACHINE if k in value}
        if key not in ("samples", "plot"):
            out[key] = value
    out["full_result"] = full_result
    return out


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def result_tag(args: argparse.Namespace) -> str:
    """The result's tag: ``--tag`` when given, else ``layouts`` when ``--layouts`` compares several, else
    ``fsdp`` or ``hsdp`` when ``--train-args`` shards the example (``--fsdp``, ``--hsdp``)."""
    import shlex

    if args.tag:
        return str(args.tag)
    if getattr(args, "layouts", None):
        return "layouts"
    train = shlex.split(getattr(args, "train_args", "") or "")
    return next((flag[2:] for flag in ("--fsdp", "--hsdp") if flag in train), "")


def _command_line(argv: Sequence[str]) -> str:
    """``python <script> <args>`` with the script relative to the repository when it lies inside it."""
    import shlex

    if not argv:
        return ""
    script = Path(argv[0]).resolve()
    shown = str(script.relative_to(REPO_ROOT)) if script.is_relative_to(REPO_ROOT) else argv[0]
    return shlex.join(["python", shown, *argv[1:]])


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).isoformat(timespec="seconds")


def _json_default(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to a benchmark result")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_repetitions(
    path: Path, series: Sequence[tuple[Sequence[float], str, str]], *, ylabel: str, title: str
) -> None:
    """One line per ``(values, matplotlib style, label)`` over the interleaved repetitions, written to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for values, style, label in series:
        ax.plot(range(1, len(values) + 1), values, style, label=label)
    ax.set_xlabel("repetition (interleaved)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def exit_worker(code: int) -> None:
    """End a benchmark's worker process with ``code``, its output flushed, skipping interpreter finalization:
    torch's gloo teardown can abort there (pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain-text table; floats get 4 significant digits, ``None`` prints as ``-``."""

    def cell(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule, *("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body)])


# --------------------------------------------------------------------------- environment


# Every port handed out below, held until this process exits (see hyperpodrun.rendezvous.ports).
_HELD_PORTS: list[PortReservation] = []


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port no other program is handed while this process lives (its server binds it with SO_REUSEADDR)."""
    held = PortReservation(host)
    _HELD_PORTS.append(held)
    return held.port


def run_rank_workers(script: str, args: Sequence[str], *, ranks: int, raw: Path, timeout_s: float) -> Any:
    """``ranks`` processes of ``script *args --worker RANK PORT RAW`` (rank 0 hosts the store on a free port),
    each given ``timeout_s``; any left running when one fails are killed. Returns the JSON rank 0 wrote to
    ``raw`` (then removed)."""
    raw.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args, "--worker", str(r), str(port), str(raw)],
            env=bench_env(OMP_NUM_THREADS="1"),
        )
        for r in range(ranks)
    ]
    try:
        for rank, proc in enumerate(procs):
            if proc.wait(timeout=timeout_s) != 0:
                raise BenchmarkError(f"{Path(script).stem} worker {rank} exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    data = json.loads(raw.read_text())
    raw.unlink()
    return data


def bench_env(**extra: str) -> dict[str, str]:
    """The environment for children: no inherited launcher variables, the repo's ``src`` importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", contract.ENV_PREFIX))}
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def hyperpodrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hyperpodrun", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def start_etcd(start_timeout: float = 30.0) -> Any:
    """Start a single-member etcd on free loopback ports (the test suite's starter)."""
    tests = str(REPO_ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support.etcd import EtcdServer  # the repo's tests/support/etcd.py

    return EtcdServer(start_timeout=start_timeout).start()


# --------------------------------------------------------------------------- the example trainer


def require_train_script() -> Path:
    """The example trainer the throughput, overhead and scale benchmarks run."""
    if not TRAIN_SCRIPT.is_file():
        raise BenchmarkError(f"the example trainer {TRAIN_SCRIPT} does not exist")
    return TRAIN_SCRIPT


def add_train_arguments(
    parser: argparse.ArgumentParser, *, global_batch: int | None = 8, micro_batch: int = 2, global_batch_is: str = ""
) -> None:
    """Flags that shape the example's training run; ``--train-args`` passes anything else through.
    ``global_batch=None``: the script fills it in after parsing, as ``global_batch_is`` tells ``--help``."""
    group = parser.add_argument_group("example trainer (examples/llama_finetune/train.py)")
    group.add_argument("--model", default="tiny", help="model preset passed to train.py [tiny]")
    group.add_argument("--seq-len", type=int, default=256, help="tokens per sample [256]")
    shown = global_batch if global_batch is not None else global_batch_is
    group.add_argument("--global-batch", type=int, default=global_batch, help=f"samples per step [{shown}]")
    group.add_argument("--micro-batch", type=int, default=micro_batch, help=f"samples per micro-batch [{micro_batch}]")
    group.add_argument("--train-args", default="", help='more train.py flags, e.g. "--fsdp --device cuda --dtype bf16"')


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """One run of the example trainer; :meth:`argv` is its command line after the script."""

    steps: int
    model: str = "tiny"
    seq_len: int = 256
    global_batch: int = 8
    micro_batch: int = 2
    min_step_time: float = 0.0
    ckpt_every: int = 0
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.min_step_time < 0:
            raise ValueError(f"min_step_time must be >= 0, got {self.min_step_time!r}")
        if self.ckpt_every < 0:
            raise ValueError(f"ckpt_every must be >= 0, got {self.ckpt_every!r}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, **fields: Any) -> TrainArgs:
        import shlex

        return cls(
            model=ns.model,
            seq_len=ns.seq_len,
            global_batch=ns.global_batch,
            micro_batch=ns.micro_batch,
            extra=tuple(shlex.split(ns.train_args)),
            **fields,
        )

    @property
    def tokens_per_step(self) -> int:
        """Nominal tokens per optimizer step (global batch x sequence length)."""
        return self.global_batch * self.seq_len

    def argv(self, *, run_dir: Path, data_cache: Path, metrics: Path) -> list[str]:
        return [
            "--model",
            self.model,
            "--steps",
            str(self.steps),
            "--seq-len",
            str(self.seq_len),
            "--global-batch",
            str(self.global_batch),
            "--micro-batch",
            str(self.micro_batch),
            "--min-step-time",
            str(self.min_step_time),
            "--ckpt-every",
            str(self.ckpt_every),
            "--log-every",
            "1",
            "--metrics",
            str(metrics),
            "--run-dir",
            str(run_dir),
            "--data-cache",
            str(data_cache),
            "--num-workers",
            "0",
            *self.extra,
        ]

    def as_params(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "extra": list(self.extra), "tokens_per_step": self.tokens_per_step}


def first_record_ts(log_dir: Path, event: str) -> float | None:
    """When hyperpodrun's event log under ``log_dir`` (its ``--log-dir``) first recorded ``event``; None if never."""
    found = records(log_dir, event)
    return float(found[0]["ts"]) if found else None


def records(log_dir: Path, event: str) -> list[dict[str, Any]]:
    """Every ``event`` record of hyperpodrun's event logs under ``log_dir`` (its ``--log-dir``), in file order."""
    found = []
    for path in sorted(log_dir.glob("**/events.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written when the launcher was stopped
            if record.get("event") == event:
                found.append(record)
    return found


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """train.py's ``--metrics`` records (rank 0, one per logged step: ts, step, loss, world_size, ...)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written when the trainer was killed
    return records


def wall_tokens_per_s(records: Sequence[Mapping[str, Any]], tokens_per_step: int, *, skip: int) -> float:
    """End-to-end tokens/s between the ``skip``-th logged step and the last one.

    Computed from step end times, so it includes everything a step costs (data,
    ``elastic_event_detected()``, logging), unlike the trainer's per-step figure.
    """
    steps = [r for r in records if r["step"] > skip]
    if len(steps) < 2:
        raise BenchmarkError(f"need at least 2 logged steps after step {skip}, got {len(steps)}")
    first, last = steps[0], steps[-1]
    return (last["step"] - first["step"]) * tokens_per_step / (last["ts"] - first["ts"])


LAUNCHERS = ("hyperpodrun", "torchrun")


def single_node_cmd(
    launcher: str, nproc: int, train: TrainArgs, *, work: Path, data_cache: Path, launcher_args: Sequence[str] = ()
) -> list[str]:
    """One node of ``nproc`` ranks under ``launcher``, both through a c10d-style rendezvous.

    hyperpodrun runs its elastic agent (``--nnodes 1:1``: store, control channel, policy
    loop all live), torchrun its c10d rendezvous agent: each launcher's normal path.
    ``launcher_args`` go to the launcher (before the script).
    """
    script = str(require_train_script())
    argv = train.argv(run_dir=work / "run", data_cache=data_cache, metrics=work / "metrics.jsonl")
    rdzv = [
        "--nnodes",
        "1:1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        f"bench-{work.name}",
    ]
    if launcher == "hyperpodrun":
        return hyperpodrun_cmd(*rdzv, "--log-dir", str(work / "logs"), *launcher_args, script, *argv)
    if launcher == "torchrun":
        return torchrun_cmd(*rdzv, *launcher_args, script, *argv)
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def run_training(
    launcher: str,
    nproc: int,
    train: TrainArgs,
    *,
    work: Path,
    data_cache: Path,
    timeout: float,
    env: Mapping[str, str],
    sample_interval: float = 1.0,
    launcher_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the example to completion on one node (raises on failure).

    Returns its per-step metrics, wall time, and the launcher process's own CPU seconds
    (its agent: monitoring, rendezvous, store), which the ranks do not get on a busy node.
    """
    work.mkdir(parents=True, exist_ok=True)
    cmd = single_node_cmd(launcher, nproc, train, work=work, data_cache=data_cache, launcher_args=launcher_args)
    done = run_to_completion(
        cmd,
        name=f"{launcher}-{nproc}",
        timeout=timeout,
        env=env,
        log_path=work / "output.log",
        sample_interval=sample_interval,
    )
    if done.returncode != 0:
        raise BenchmarkError(f"{launcher} with {nproc} rank(s) exited {done.returncode}; output tail:\n{done.tail()}")
    records = read_metrics(work / "metrics.jsonl")
    if not records or records[-1]["step"] != train.steps:
        raise BenchmarkError(
            f"{launcher} with {nproc} rank(s) logged {len(records)} steps, expected up to {train.steps}"
        )
    return {
        "launcher": launcher,
        "nproc": nproc,
        "wall_s": done.wall_s,
        "launcher_cpu_s": done.own_cpu_s,
        "launcher_cpu_fraction": done.own_cpu_s / done.wall_s,
        "cpu_samples": [dataclasses.astuple(c) for c in done.cpu_samples],
        "metrics": records,
    }


# --------------------------------------------------------------------------- processes


@dataclasses.dataclass(frozen=True)
class OutputLine:
    """One line a child printed, stamped with ``time.time()`` when it arrived."""

    ts: float
    source: str
    stream: str
    text: str


class OutputBus:
    """Collects the timestamped lines of several children; waiters wake on every line."""

    def __init__(self) -> None:
        self._lines: list[OutputLine] = []
        self._cond = threading.Condition()

    def append(self, line: OutputLine) -> None:
        with self._cond:
            self._lines.append(line)
            self._cond.notify_all()

    def lines(self) -> list[OutputLine]:
        with self._cond:
            return list(self._lines)

    def wait_for(self, predicate: Callable[[list[OutputLine]], Any], *, timeout: float, what: str) -> Any:
        """Block until ``predicate(lines)`` is truthy and return its value; re-checked on every line.

        Also re-checked every second, so predicates that look at the clock or at
        processes (not only at lines) are evaluated too.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate(self._lines)
                if value:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BenchmarkTimeoutError(what, timeout)
                self._cond.wait(min(remaining, 1.0))


def kill_tree(pid: int, *, sig: int = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
    """Send ``sig`` to ``pid`` and every descendant at once (collected first); returns the pids.

    SIGKILL of the whole tree is how a benchmark simulates the loss of a node, and how
    every child is cleaned up at the end.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if sig == signal.SIGKILL:
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        if alive:
            raise BenchmarkTimeoutError(f"exit of killed processes {[p.pid for p in alive]}", timeout)
    return [p.pid for p in procs]


class ManagedProcess:
    """A child in its own session, output lines timestamped into an :class:`OutputBus`.

    Also copied to ``log_path`` when given. Leaving the ``with`` block (or :meth:`close`)
    kills the whole process tree, so no benchmark leaves anything running.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO_ROOT,
        bus: OutputBus | None = None,
        log_path: Path | None = None,
        stdin: bool = False,
    ) -> None:
        self.cmd = list(cmd)
        self.name = name
        self.bus = bus if bus is not None else OutputBus()
        self.log_path = log_path
        self.started_at = time.time()
        self._log: IO[str] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        self._log_lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.cmd,
            env=dict(env) if env is not None else bench_env(),
            cwd=cwd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self, stream: IO[str] | None, label: str) -> None:
        assert stream is not None
        for raw in stream:
            line = OutputLine(time.time(), self.name, label, raw.rstrip("\n"))
            self.bus.append(line)
            if self._log is not None:
                with self._log_lock:
                    if not self._log.closed:
                        self._log.write(f"{line.ts:.3f} {label} {line.text}\n")
        stream.close()

    def lines(self) -> list[OutputLine]:
        return [line for line in self.bus.lines() if line.source == self.name]

    def tail(self, n: int = 20) -> str:
        return "\n".join(f"[{self.name}] {line.text}" for line in self.lines()[-n:])

    def send(self, text: str) -> None:
        """Write a line to the child's stdin (only when started with ``stdin=True``)."""
        if self.proc.stdin is None:
            raise BenchmarkError(f"{self.name} was started without a stdin pipe")
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Signal the child itself (e.g. SIGTERM to a launcher asks it to leave gracefully)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait for exit; raises :class:`BenchmarkTimeoutError` naming the child."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkTimeoutError(f"exit of {self.name} (pid {self.pid})", timeout) from None
        for reader in self._readers:
            reader.join(timeout=5.0)
        return rc

    def kill_tree(self) -> list[int]:
        """SIGKILL the child and all its descendants at once (node loss, cleanup)."""
        pids = kill_tree(self.proc.pid)
        self.proc.wait(10.0)
        return pids

    def close(self) -> None:
        if self.proc.poll() is None or _has_children(self.proc.pid):
            self.kill_tree()
        for reader in self._readers:
            reader.join(timeout=5.0)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self._log is not None:
            with self._log_lock:
                self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _has_children(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return False


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """CPU seconds (user + system) at wall time ``ts``: of the child itself, and of its live descendants."""

    ts: float
    own_s: float
    descendants_s: float


@dataclasses.dataclass(frozen=True)
class Completed:
    """A child that ran to its end: exit code, output, wall time and its own CPU time."""

    returncode: int
    lines: list[OutputLine]
    wall_s: float
    own_cpu_s: float
    """CPU seconds of the child process itself, not its children (for a launcher: the agent's cost)."""
    cpu_samples: list[CpuSample] = dataclasses.field(default_factory=list)
    """Sampled while it ran: for a launcher, ``descendants_s`` is its ranks' (and their workers') CPU."""

    def tail(self, n: int = 20) -> str:
        return "\n".join(line.text for line in self.lines[-n:])


def _cpu_sample(pid: int) -> CpuSample | None:
    import psutil

    try:
        root = psutil.Process(pid)
        times = root.cpu_times()
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    below = 0.0
    for child in children:
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        below += t.user + t.system
    return CpuSample(time.time(), times.user + times.system, below)


def run_to_completion(
    cmd: Sequence[str],
    *,
    name: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    sample_interval: float = 1.0,
) -> Completed:
    """Run a child to its end under a hard deadline.

    Raises :class:`BenchmarkTimeoutError` (after killing the tree) when it overruns. The
    CPU time of the child and of its descendants is sampled every ``sample_interval``
    seconds while it runs (the last sample is taken within that interval of its exit).
    """
    start = time.monotonic()
    samples: list[CpuSample] = []
    with ManagedProcess(cmd, name=name, env=env, log_path=log_path) as proc:
        while True:
            sample = _cpu_sample(proc.pid)
            if sample is not None:
                samples.append(sample)
            remaining = start + timeout - time.monotonic()
            try:
                rc = proc.wait(max(0.01, min(sample_interval, remaining)))
                break
            except BenchmarkTimeoutError:
                if remaining <= sample_interval:
                    raise BenchmarkTimeoutError(f"exit of {name}; last output:\n{proc.tail()}", timeout) from None
        own = samples[-1].own_s if samples else 0.0
        return Completed(rc, proc.lines(), time.monotonic() - start, own, samples)
