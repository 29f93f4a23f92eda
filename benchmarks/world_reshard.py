"""World reshard: moving the full state of a model sharded over the whole world (FSDP2) through one rank,
by rows in buckets, against DCP's per-tensor paths, in the same processes.

At a scale event of an FSDP2 model over the world, the old group gathers the full state onto the new
round's rank 0 and the new group takes its shards of it. Each repetition, on ``--ranks`` gloo ranks:

* gather: ``gather_full_state`` (each rank's rows of many tensors in one ``dist.gather`` per bucket,
  onto rank 0 alone) against the baseline, ``DTensor.full_tensor()`` of every tensor of DCP's state
  dicts (one all-gather per tensor, every rank receiving every tensor);
* load: ``scatter_full_state`` into a fresh model and AdamW (each rank only its rows, one
  ``dist.scatter`` per bucket; the optimizer state loaded by name) against the baseline,
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict`` and
  ``broadcast_from_rank0`` (a broadcast per full tensor, after one optimizer step on zero gradients);

interleaved, after a warm-up repetition; the model is an embedding and ``Linear`` pairs sized to
``--params-m`` million parameters (fp32, AdamW: 16 bytes a parameter over the ranks).

    python benchmarks/world_reshard.py [--quick | --smoke] [--ranks 4] [--params-m N] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import (
    BenchmarkResult,
    exit_worker,
    format_table,
    median,
    parse_args,
    pyplot,
    result_tag,
    run_rank_workers,
)

NAME = "world_reshard"
PARAMS_M = {"smoke": 5, "quick": 80, "full": 125}
REPS = {"smoke": 1, "quick": 3, "full": 5}
WIDTH = {"smoke": 128, "quick": 768, "full": 768}
VOCAB = 32000
KINDS = ("gather_new_s", "gather_dcp_s", "load_new_s", "load_dcp_s")


# --------------------------------------------------------------------------- worker side


def build(width: int, layers: int) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)) for _ in range(layers)
    ]
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, width), *blocks)
    for module in model:
        fully_shard(module)
    return fully_shard(model)


def layers_for(params_m: float, width: int) -> int:
    """``Linear`` pairs (8 width² + 5 width parameters each) that bring the embedding up to ``params_m`` M."""
    return max(1, round((params_m * 1e6 - VOCAB * width) / (8 * width * width + 5 * width)))


def worker_main(rank: int, world: int, port: int, ns: argparse.Namespace, out: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from elastic_events.rounds.full_scatter import scatter_full_state
    from elastic_events.rounds.hydration import gather_full_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    bucket = int(ns.bucket_mb * 2**20)
    width, layers = ns.width, layers_for(ns.params_m, ns.width)
    model = build(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, VOCAB, (16,))).sum().backward()  # 2-D activations: no view returned
    optimizer.step()
    optimizer.zero_grad()

    def full_tree(tree: Any) -> Any:
        if isinstance(tree, DTensor):
            full = tree.full_tensor()
            return full.cpu() if rank == 0 else None
        if isinstance(tree, dict):
            return {k: full_tree(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [full_tree(v) for v in tree]
        return tree.detach().cpu().clone() if isinstance(tree, torch.Tensor) and rank == 0 else tree

    def gather_dcp() -> None:
        full_tree(get_model_state_dict(model))
        full_tree(get_optimizer_state_dict(model, optimizer))

    full = gather_full_state(model, optimizer, holder=0, bucket_bytes=bucket)
    nbytes = 0
    if full is not None:
        nbytes = sum(t.numel() * t.element_size() for t in full.model.values())
        nbytes += sum(t.numel() * t.element_size() for s in full.optimizer["state"].values() for t in s.values())

    def load(new: bool) -> float:
        fresh = build(width, layers)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        copy = None
        if full is not None:  # DCP's broadcast path replaces the dicts' tensors it is given: a copy each time
            copy = type(full)(model=dict(full.model), optimizer=copy_containers(full.optimizer))
        dist.barrier()
        t0 = time.perf_counter()
        if new:
            if not scatter_full_state(fresh, fresh_opt, copy, src=0, device=torch.device("cpu"), bucket_bytes=bucket):
                raise RuntimeError("the rows path refused this model")
        else:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(fresh, copy.model if copy else {}, options=options)
            set_optimizer_state_dict(fresh, fresh_opt, copy.optimizer if copy else {}, options=options)
        dist.barrier()
        return time.perf_counter() - t0

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    for rep in range(ns.reps + 1):  # the first is a warm-up: connections, allocator, imports
        got = {
            "gather_new_s": timed(lambda: gather_full_state(model, optimizer, holder=0, bucket_bytes=bucket)),
            "gather_dcp_s": timed(gather_dcp),
            "load_new_s": load(True),
            "load_dcp_s": load(False),
        }
        if rep:
            for k, v in got.items():
                samples[k].append(v)
    if rank == 0:
        params = sum(t.numel() for t in full.model.values())
        out.write_text(json.dumps({"params": params, "layers": layers, "state_bytes": nbytes, **samples}))
    dist.destroy_process_group()
    return 0


def copy_containers(tree: Any) -> Any:
    """A copy of the containers of ``tree`` (tensors shared): what DCP replaces in place stays intact."""
    if isinstance(tree, dict):
        return {k: copy_containers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [copy_containers(v) for v in tree]
    return tree


# --------------------------------------------------------------------------- driver side


def measure(ns: argparse.Namespace, raw: Path, timeout_s: float = 1800.0) -> dict[str, Any]:
    args = ["--ranks", str(ns.ranks), "--bucket-mb", str(ns.bucket_mb), "--params-m", str(ns.params_m)]
    args += ["--width", str(ns.width), "--reps", str(ns.reps)]
    return run_rank_workers(__file__, args, ranks=ns.ranks, raw=raw, timeout_s=timeout_s)  # type: ignore[no-any-return]


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["gather: rows, buckets", "gather: full_tensor", "load: rows, buckets", "load: DCP broadcast"]
    ax.bar(labels, [median(data[k]) for k in KINDS], color=["C0", "0.6", "C1", "0.6"])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Full state of {data['params'] / 1e6:.0f} M parameters through one rank")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ranks", type=int, default=4, help="gloo ranks the model is sharded over [4]")
        p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket bound per rank [64]")
        p.add_argument(
            "--params-m", type=float, default=None, help="model size, M parameters (smoke 5, quick 80, full 125)"
        )
        p.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
        p.add_argument("--reps", type=int, default=None, help="timed repetitions (smoke 1, quick 3, full 5)")
        p.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "FILE"), help=argparse.SUPPRESS)

    ns = parse_args(__doc__.splitlines()[0], add_arguments=options, argv=argv)
    if ns.ranks < 2:
        raise SystemExit(f"{NAME}.py: --ranks must be >= 2")
    ns.params_m = ns.params_m or PARAMS_M[ns.mode]
    ns.width = ns.width or WIDTH[ns.mode]
    ns.reps = ns.reps or REPS[ns.mode]
    if ns.worker:
        rank, port, file = ns.worker
        code = worker_main(int(rank), ns.ranks, int(port), ns, Path(file))
        exit_worker(code)
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=result_tag(ns),
        params={
            "ranks": ns.ranks,
            "bucket_mb": ns.bucket_mb,
            "params_m": ns.params_m,
            "width": ns.width,
            "reps": ns.reps,
            "backend": "gloo",
            "optimizer": "AdamW",
        },
        baseline="DCP's paths on the same model in the same processes, interleaved: DTensor.full_tensor() of every "
        "tensor of the state dicts, and set_*_state_dict with full_state_dict and broadcast_from_rank0",
        notes=[
            "Loopback gloo on CPU: every rank shares the machine's cores and memory bandwidth.",
            "Gather timed on every rank from a barrier to a barrier; load includes nothing of building the fresh model.",
        ],
    )
    data = measure(ns, ns.out / f"{NAME}_{ns.mode}.raw.json")
    med = {k: median(data[k]) for k in KINDS}
    summary = {
        "params": data["params"],
        "state_mb": round(data["state_bytes"] / 2**20, 1),
        **{f"{k[:-2]}_median_s": round(v, 4) for k, v in med.items()},
        "gather_speedup": round(med["gather_dcp_s"] / med["gather_new_s"], 3),
        "load_speedup": round(med["load_dcp_s"] / med["load_new_s"], 3),
        "gather_speedup_per_rep": [round(b / a, 3) for a, b in zip(data["gather_new_s"], data["gather_dcp_s"])],
        "load_speedup_per_rep": [round(b / a, 3) for a, b in zip(data["load_new_s"], data["load_dcp_s"])],
    }
    result.samples, result.summary = data, summary
    plot(data, result.plot_path(ns.out))
    path = result.write(ns.out)
    print(
        format_table(
            ["state MB", "gather s (DCP)", "load s (DCP)", "gather x", "load x"],
            [
                [
                    summary["state_mb"],
                    f"{med['gather_new_s']:.3f} ({med['gather_dcp_s']:.3f})",
                    f"{med['load_new_s']:.3f} ({med['load_dcp_s']:.3f})",
                    summary["gather_speedup"],
                    summary["load_speedup"],
                ]
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
