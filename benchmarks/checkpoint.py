"""Checkpoint bandwidth: DCP save and load through ``Checkpointer`` against the raw disk.

For each state (the example's model + AdamW state, and synthetic states of fixed size)
and each repetition, in the same run and the same directory:

* raw write: the same number of bytes written in 16 MiB chunks, then ``fsync``;
* raw read: read back after evicting the file from the page cache, then again warm;
* DCP save: ``Checkpointer.save`` (DCP files fsynced, ``COMPLETE`` marker, atomic rename);
* DCP load: ``Checkpointer.load`` into fresh objects, cold (evicted) and warm.

Page cache: evicted per file with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after the data is
fsynced; that needs no privileges (no global ``drop_caches``). A read-back is "cold" as far
as this host's page cache goes; storage below it (a hypervisor's cache, a filer) may still
serve it from memory.

Resharded load: the example's model, FSDP2-sharded and saved by 2 ranks, loaded by 1 rank
(resharded) and by 2 ranks (the same-size baseline), each launched with
``torch.distributed.run``.

    python benchmarks/checkpoint.py [--quick | --smoke] [--dir /shared/fs/path] [--model tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import (
    REPO_ROOT,
    BenchmarkError,
    BenchmarkResult,
    bench_env,
    format_table,
    median,
    parse_args,
    pyplot,
    result_tag,
    run_to_completion,
    torchrun_cmd,
)
from elastic_events.checkpoint import CheckpointConfig, Checkpointer

NAME = "checkpoint"
MB = 1_000_000
CHUNK = 16 * 2**20
SYNTHETIC_MB = {"smoke": (8,), "quick": (50,), "full": (50, 200, 1000)}
REPS = {"smoke": 1, "quick": 3, "full": 5}
RESHARD_REPS = {"smoke": 1, "quick": 2, "full": 3}
EXAMPLE_DIR = REPO_ROOT / "examples" / "llama_finetune"


# --------------------------------------------------------------------------- page cache and raw disk


def evict(path: Path) -> int:
    """Drop ``path`` (a file, or every file below a directory) from the page cache; returns bytes."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` and fsync them (the file is closed afterwards)."""
    chunk = os.urandom(CHUNK)
    view = memoryview(chunk)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[: min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(path: Path) -> float:
    """Seconds to read the whole file."""
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- states


State = tuple[torch.nn.Module, torch.optim.Optimizer]


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _with_adamw(model: torch.nn.Module) -> State:
    """``model`` and an AdamW whose moments exist (one step on zero gradients)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def example_model(model_name: str) -> torch.nn.Module:
    """The example's Llama (``--model`` preset) on the meta device: shapes only."""
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    from model import Llama, LlamaConfig  # examples/llama_finetune/model.py

    with torch.device("meta"):
        return Llama(LlamaConfig.from_name(model_name))


def example_state(model_name: str, device: torch.device, seed: int = 0) -> State:
    """The example's Llama and its AdamW state."""
    model = example_model(model_name).to_empty(device=device)
    model.init_weights(seed)
    return _with_adamw(model)


def synthetic_state(total_mb: int, device: torch.device) -> State:
    """Parameters of ``total_mb / 3`` MB in 16 MiB tensors, plus AdamW's two moments: ``total_mb`` in all."""
    param_bytes = total_mb * MB // 3
    numel = CHUNK // 4
    sizes = [numel] * (param_bytes // CHUNK) + ([param_bytes % CHUNK // 4] if param_bytes % CHUNK >= 4 else [])
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes)
    return _with_adamw(model)


# --------------------------------------------------------------------------- single-process bandwidth


def measure_state(label: str, build: Callable[[], State], root: Path, reps: int) -> dict[str, Any]:
    """Raw disk and DCP save/load of one state, ``reps`` times; which goes first alternates."""
    model, optimizer = build()
    dest_model, dest_optimizer = build()  # prepared before timing: a restart builds these anyway
    rows: list[dict[str, float]] = []
    for rep in range(reps):
        if rep % 2 == 0:
            dcp_times = _dcp_round_trip(label, rep + 1, root, model, optimizer, dest_model, dest_optimizer)
            raw_times = _raw_round_trip(label, root, int(dcp_times["bytes"]))
        else:  # the same byte count as the previous DCP save
            raw_times = _raw_round_trip(label, root, int(rows[-1]["bytes"]))
            dcp_times = _dcp_round_trip(label, rep + 1, root, model, optimizer, dest_model, dest_optimizer)
        rows.append({**dcp_times, **raw_times})
    return {"state": label, "bytes": rows[0]["bytes"], "reps": rows, **_bandwidths(rows)}


def _dcp_round_trip(
    label: str,
    step: int,
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dest_model: torch.nn.Module,
    dest_optimizer: torch.optim.Optimizer,
) -> dict[str, float]:
    ckpt_dir = root / f"{label}-dcp"
    ckpt = Checkpointer(CheckpointConfig(dir=ckpt_dir, keep_last=1))
    start = time.perf_counter()
    saved = ckpt.save(step, model=model, optimizer=optimizer)
    save_s = time.perf_counter() - start
    nbytes = disk_bytes(saved)
    evict(saved)
    start = time.perf_counter()
    loaded = ckpt.load(model=dest_model, optimizer=dest_optimizer)
    load_cold_s = time.perf_counter() - start
    if loaded is None or loaded.step != step:
        raise BenchmarkError(f"{label}: loaded {loaded!r}, expected step {step}")
    start = time.perf_counter()
    ckpt.load(model=dest_model, optimizer=dest_optimizer)
    load_warm_s = time.perf_counter() - start
    shutil.rmtree(ckpt_dir)
    return {"bytes": nbytes, "dcp_save_s": save_s, "dcp_load_cold_s": load_cold_s, "dcp_load_warm_s": load_warm_s}


def _raw_round_trip(label: str, root: Path, nbytes: int) -> dict[str, float]:
    raw = root / f"{label}-raw.bin"
    write_s = raw_write(raw, nbytes)
    evict(raw)
    read_cold_s = raw_read(raw)
    read_warm_s = raw_read(raw)
    raw.unlink()
    return {"raw_write_s": write_s, "raw_read_cold_s": read_cold_s, "raw_read_warm_s": read_warm_s}


def _bandwidths(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median GB/s of every operation and DCP's fraction of the raw disk's."""
    gbps = {
        key[: -len("_s")] + "_gbps": median(r["bytes"] / r[key] / 1e9 for r in rows)
        for key in rows[0]
        if key.endswith("_s")
    }
    return {
        **gbps,
        "save_fraction_of_disk": gbps["dcp_save_gbps"] / gbps["raw_write_gbps"],
        "load_cold_fraction_of_disk": gbps["dcp_load_cold_gbps"] / gbps["raw_read_cold_gbps"],
        "load_warm_fraction_of_page_cache": gbps["dcp_load_warm_gbps"] / gbps["raw_read_warm_gbps"],
    }


# --------------------------------------------------------------------------- resharded load (worker side)


def worker_main(args: argparse.Namespace) -> int:
    """Under torch.distributed.run: ``save`` or ``load`` the FSDP2-sharded example state; rank 0 reports."""
    device = _device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        model = example_model(args.model)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        model.init_weights(seed=1 if args.worker == "load" else 0)
        model, optimizer = _with_adamw(model)
        ckpt = Checkpointer(CheckpointConfig(dir=args.dir, keep_last=None))
        dist.barrier()
        start = time.perf_counter()
        if args.worker == "save":
            ckpt.save(args.step, model=model, optimizer=optimizer)
        else:
            loaded = ckpt.load(model=model, optimizer=optimizer, step=args.step)
            if loaded is None:
                raise BenchmarkError(f"no checkpoint of step {args.step} under {args.dir}")
        dist.barrier()
        elapsed = time.perf_counter() - start
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps({"op": args.worker, "world": dist.get_world_size(), "s": elapsed}))
    finally:
        dist.destroy_process_group()
    return 0


def _launch(args: argparse.Namespace, op: str, world: int, ckpt_dir: Path, step: int, work: Path) -> float:
    result = work / f"{op}-w{world}-{step}.json"
    cmd = torchrun_cmd(
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(Path(__file__).resolve()),
        "--worker",
        op,
        "--dir",
        str(ckpt_dir),
        "--step",
        str(step),
        "--result",
        str(result),
        "--model",
        args.model,
        "--device",
        args.device,
    )
    env = bench_env(OMP_NUM_THREADS=str(args.threads))
    done = run_to_completion(cmd, name=f"{op}-w{world}", timeout=args.launch_timeout, env=env)
    if done.returncode != 0:
        raise BenchmarkError(f"{op} at world {world} exited {done.returncode}:\n{done.tail()}")
    return json.loads(result.read_text())["s"]


def measure_reshard(args: argparse.Namespace, root: Path, reps: int) -> dict[str, Any]:
    """Save at world 2; load at world 2 (baseline) and at world 1 (resharded), each ``reps`` times."""
    ckpt_dir = root / "reshard"
    save_s = [_launch(args, "save", 2, ckpt_dir, step, root) for step in range(1, reps + 1)]
    nbytes = disk_bytes(ckpt_dir / f"step_{reps:09d}")
    same, resharded = [], []
    for rep in range(reps):
        step = rep + 1
        evict(ckpt_dir)
        same.append(_launch(args, "load", 2, ckpt_dir, step, root))
        evict(ckpt_dir)
        resharded.append(_launch(args, "load", 1, ckpt_dir, step, root))
    shutil.rmtree(ckpt_dir)
    return {
        "model": args.model,
        "wrap": "fsdp2",
        "bytes": nbytes,
        "save_w2_s": save_s,
        "load_w2_s": same,
        "load_w1_resharded_s": resharded,
        "save_w2_median_s": median(save_s),
        "load_w2_median_s": median(same),
        "load_w1_resharded_median_s": median(resharded),
        "resharded_over_same_size": median(resharded) / median(same),
    }


# --------------------------------------------------------------------------- driver


def plot(result: BenchmarkResult, states: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{s['state']}\n{s['bytes'] / MB:.0f} MB" for s in states]
    xs = range(len(states))
    width = 0.2
    for ax, pairs, title in (
        (ax1, (("raw_write_gbps", "raw write+fsync"), ("dcp_save_gbps", "DCP save")), "write"),
        (
            ax2,
            (
                ("raw_read_cold_gbps", "raw read (cold)"),
                ("dcp_load_cold_gbps", "DCP load (cold)"),
                ("raw_read_warm_gbps", "raw read (warm)"),
                ("dcp_load_warm_gbps", "DCP load (warm)"),
            ),
            "read",
        ),
    ):
        for i, (key, label) in enumerate(pairs):
            ax.bar([x + (i - (len(pairs) - 1) / 2) * width for x in xs], [s[key] for s in states], width, label=label)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("GB/s (median)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"checkpoint vs raw disk ({result.mode}; {result.params['dir_fs']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def _work_dir(base: Path | None, out: Path) -> Iterator[Path]:
    parent = base if base is not None else out
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _filesystem(path: Path) -> str:
    best = ("", "?")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, fstype)
    return f"{best[1]} at {best[0] or '?'}"


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--dir", type=Path, default=None, help="where to write (the storage to measure); default --out"
        )
        parser.add_argument(
            "--model", default="tiny", help="example model preset for the example state and the reshard"
        )
        parser.add_argument("--device", default="auto", help="auto, cpu or cuda (state is saved from this device)")
        parser.add_argument(
            "--sizes-mb",
            type=lambda s: tuple(int(x) for x in s.split(",")),
            default=None,
            help="synthetic state sizes in MB (default by mode)",
        )
        parser.add_argument("--launch-timeout", type=float, default=300.0, help="hard limit per torchrun launch, s")
        parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process [1]")
        # internal: the torch.distributed.run worker of the resharded load
        parser.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
        parser.add_argument("--step", type=int, help=argparse.SUPPRESS)
        parser.add_argument("--result", help=argparse.SUPPRESS)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    if args.worker:
        return worker_main(args)
    torch.set_num_threads(args.threads)  # as under a launcher; spare threads only spin on a busy machine
    sizes = args.sizes_mb or SYNTHETIC_MB[args.mode]
    reps = REPS[args.mode]
    device = _device(args.device)
    with _work_dir(args.dir, args.out) as work:
        result = BenchmarkResult(
            name=NAME,
            mode=args.mode,
            tag=result_tag(args),
            params={
                "model": args.model,
                "synthetic_mb": list(sizes),
                "reps": reps,
                "reshard_reps": RESHARD_REPS[args.mode],
                "device": str(device),
                "threads": args.threads,
                "dir": str(work),
                "dir_fs": _filesystem(work),
                "chunk_bytes": CHUNK,
                "page_cache": "evicted per file with posix_fadvise(DONTNEED) after fsync before every cold read/load",
                "checkpointer": "CheckpointConfig(keep_last=1, sync_files=True, io_threads=1), synchronous save",
            },
            baseline=(
                "raw write+fsync and raw read of the same byte count in the same directory, "
                "alternating with each DCP rep"
            ),
        )
        states = [measure_state(f"example-{args.model}", lambda: example_state(args.model, device), work, reps)]
        for mb in sizes:
            states.append(measure_state(f"synthetic-{mb}MB", lambda mb=mb: synthetic_state(mb, device), work, reps))
        reshard = measure_reshard(args, work, RESHARD_REPS[args.mode])
    result.samples = {"states": states, "reshard": reshard}
    result.summary = {
        s["state"]: {k: v for k, v in s.items() if k.endswith(("_gbps", "_of_disk", "_of_page_cache")) or k == "bytes"}
        for s in states
    }
    result.summary["reshard"] = {k: v for k, v in reshard.items() if not isinstance(v, list)}
    result.notes += [
        (
            "Small states are dominated by fixed costs (DCP planning, metadata, the COMPLETE marker, "
            "directory fsyncs and the rename), not bandwidth; the fraction of disk bandwidth is meaningful "
            "for the larger synthetic states."
        ),
        "DCP writes one file per rank with one I/O thread here; more ranks or io_threads parallelise writes.",
        (
            "Resharded load times include process start and process-group setup only outside the timed "
            "region: the timer covers Checkpointer.load between two barriers."
        ),
    ]
    plot(result, states, result.plot_path(args.out))
    path = result.write(args.out)
    rows = [
        (
            s["state"],
            s["bytes"] / MB,
            s["raw_write_gbps"],
            s["dcp_save_gbps"],
            s["save_fraction_of_disk"],
            s["raw_read_cold_gbps"],
            s["dcp_load_cold_gbps"],
            s["load_cold_fraction_of_disk"],
        )
        for s in states
    ]
    print(
        format_table(
            [
                "state",
                "MB",
                "disk write GB/s",
                "DCP save GB/s",
                "save/disk",
                "disk read GB/s",
                "DCP load GB/s",
                "load/disk",
            ],
            rows,
        )
    )
    print(
        f"reshard ({reshard['model']}, {reshard['bytes'] / MB:.1f} MB): save@2 {reshard['save_w2_median_s']:.3f}s, "
        f"load@2 {reshard['load_w2_median_s']:.3f}s, load@1 (resharded) {reshard['load_w1_resharded_median_s']:.3f}s "
        f"(x{reshard['resharded_over_same_size']:.2f})"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
