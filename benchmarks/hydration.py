"""Peer hydration bandwidth: a newcomer receiving model + optimizer state from a survivor,
against a plain ``dist.broadcast`` of the same number of bytes on the same gloo group.

Each repetition, interleaved with the baseline in the same processes:

* hydration: what ``ElasticTraining`` does for a replicated model -- the source splits
  its optimizer state into a skeleton (one ``broadcast_object_list``) and tensors, the
  newcomers allocate theirs, then every parameter and optimizer tensor travels through
  ``broadcast_tensors`` (buckets of at most ``--bucket-mb``) and the newcomers load the
  optimizer state;
* baseline: one ``dist.broadcast`` of a flat byte tensor of the same size;
* the memory bound: one ``copy_`` of that many bytes on the source (memcpy).

Target: hydration bandwidth >= 0.5x the baseline. :func:`measure` runs one such measurement at
any state size (``state_scaling.py`` uses it per model size).

    python benchmarks/hydration.py [--quick | --smoke] [--ranks 2] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

from common import (
    BenchmarkResult,
    exit_worker,
    format_table,
    median,
    parse_args,
    plot_repetitions,
    result_tag,
    run_rank_workers,
)

NAME = "hydration"
STATE_MB = {"smoke": 4, "quick": 96, "full": 512}  # parameters + AdamW state (3x the parameters)
REPS = {"smoke": 2, "quick": 5, "full": 9}


# --------------------------------------------------------------------------- worker side


def worker_main(rank: int, world: int, port: int, state_mb: int, bucket_mb: float, reps: int, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from elastic_events.rounds.hydration import allocate_tensors, model_tensors, split_tensors
    from elastic_events.rounds.transfer import broadcast_tensors

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    width = 1024
    layers = max(1, state_mb * 2**20 // (4 * 4 * width * width))  # fp32 weights, 4 copies with AdamW state
    torch.manual_seed(rank)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:  # the survivor has optimizer state; newcomers do not yet
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
    device = torch.device("cpu")
    bucket_bytes = int(bucket_mb * 2**20)

    def hydrate() -> int:
        sending = rank == 0
        skeleton, optim_tensors = split_tensors(optimizer.state_dict()) if sending else (None, [])
        box = [skeleton]
        dist.broadcast_object_list(box, src=0)
        if not sending:
            received, optim_tensors = allocate_tensors(box[0], device)
        tensors = [t for _, t in model_tensors(model)] + optim_tensors
        stats = broadcast_tensors(tensors, src=0, device=device, bucket_bytes=bucket_bytes)
        if not sending:
            optimizer.load_state_dict(received)
        return stats.nbytes

    nbytes = hydrate()  # warm-up: connections, allocations
    flat = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(flat, src=0)
    copy = torch.empty_like(flat) if rank == 0 else flat

    def memcpy() -> None:
        if rank == 0:
            copy.copy_(flat)

    samples: dict[str, list[float]] = {"hydration_s": [], "broadcast_s": [], "memcpy_s": []}
    for _ in range(reps):
        for key, fn in (
            ("hydration_s", hydrate),
            ("broadcast_s", lambda: dist.broadcast(flat, src=0)),
            ("memcpy_s", memcpy),
        ):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            samples[key].append(time.perf_counter() - t0)
    if rank == 0:
        out.write_text(json.dumps({"nbytes": nbytes, "layers": layers, **samples}))
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- driver side


def plot(data: dict, path: Path) -> None:
    mb = data["nbytes"] / 2**20
    plot_repetitions(
        path,
        [
            ([mb / t for t in data["hydration_s"]], "o-", "hydration (bucketed, + optimizer skeleton)"),
            ([mb / t for t in data["broadcast_s"]], "s--", "plain dist.broadcast, same bytes"),
        ],
        ylabel="MB/s",
        title=f"Peer hydration of {mb:.0f} MB on gloo",
    )


def measure(*, state_mb: int, ranks: int, bucket_mb: float, reps: int, raw: Path, timeout_s: float = 900.0) -> dict:
    """One measurement in ``ranks`` worker processes: a model of ``state_mb`` MB of fp32 parameters + AdamW
    state hydrated, broadcast and copied ``reps`` times, interleaved. Returns rank 0's samples (``nbytes``
    sent, ``hydration_s``, ``broadcast_s``, ``memcpy_s``); ``raw`` is where the workers leave them."""
    if ranks < 2 or state_mb < 1 or reps < 1:
        raise ValueError(f"ranks must be >= 2, state_mb and reps >= 1, got {ranks}, {state_mb}, {reps}")
    args = ["--ranks", str(ranks), "--bucket-mb", str(bucket_mb), "--state-mb", str(state_mb), "--reps", str(reps)]
    return run_rank_workers(__file__, args, ranks=ranks, raw=raw, timeout_s=timeout_s)


def main(argv: list[str] | None = None) -> int:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ranks", type=int, default=2, help="the source plus newcomers (default 2)")
        p.add_argument("--bucket-mb", type=float, default=64.0)
        p.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "FILE"), help=argparse.SUPPRESS)
        p.add_argument("--state-mb", type=int, default=None, help=argparse.SUPPRESS)
        p.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)

    ns = parse_args(__doc__.splitlines()[0], add_arguments=options, argv=argv)
    if ns.ranks < 2:
        raise SystemExit("hydration.py: --ranks must be >= 2 (a source and a newcomer)")
    state_mb, reps = ns.state_mb or STATE_MB[ns.mode], ns.reps or REPS[ns.mode]
    if ns.worker:
        rank, port, file = ns.worker
        code = worker_main(int(rank), ns.ranks, int(port), state_mb, ns.bucket_mb, reps, Path(file))
        exit_worker(code)
    # Made before the workers start: its start time, load and versions are those of the run.
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=result_tag(ns),
        params={"ranks": ns.ranks, "bucket_mb": ns.bucket_mb, "state_mb": state_mb, "reps": reps, "backend": "gloo"},
        baseline="one dist.broadcast of a flat byte tensor of the same size, same group, interleaved",
        notes=["Loopback gloo on CPU: both sides copy through memory; on NCCL the staging copies run on the GPU."],
    )
    data = measure(
        state_mb=state_mb, ranks=ns.ranks, bucket_mb=ns.bucket_mb, reps=reps, raw=ns.out / f"{NAME}_{ns.mode}.raw.json"
    )
    mb = data["nbytes"] / 2**20
    hyd, base = median(data["hydration_s"]), median(data["broadcast_s"])
    ratios = [b / h for h, b in zip(data["hydration_s"], data["broadcast_s"])]
    summary = {
        "state_mb": round(mb, 1),
        "hydration_mb_per_s": round(mb / hyd, 1),
        "broadcast_mb_per_s": round(mb / base, 1),
        "memcpy_mb_per_s": round(mb / median(data["memcpy_s"]), 1),
        "ratio_to_broadcast": round(base / hyd, 3),
        "ratio_per_rep_min": round(min(ratios), 3),
        "ratio_per_rep_max": round(max(ratios), 3),
        "target": ">= 0.5",
    }
    result.samples, result.summary = data, summary
    plot(data, result.plot_path(ns.out))
    path = result.write(ns.out)
    print(
        format_table(
            ["state MB", "hydration MB/s", "broadcast MB/s", "ratio"],
            [
                [
                    summary["state_mb"],
                    summary["hydration_mb_per_s"],
                    summary["broadcast_mb_per_s"],
                    summary["ratio_to_broadcast"],
                ]
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
