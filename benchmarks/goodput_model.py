"""Goodput projection: in-place repair, checkpoint restart and a torchft-like per-step quorum, 64 to 16,384 GPUs.

A model, not a measurement: it takes the per-event costs measured by the other benchmarks (the committed
summaries in ``benchmarks/results/summary/`` and the H100 check in ``benchmarks/results/gpu/``), published
failure rates and storage bandwidths of real clusters, and named assumptions for what was not measured here,
and projects goodput (useful time / wall time) past this machine. It is checked against the one published
side-by-side run (Clockwork: Llama-4 Scout, 64 H200, 3,000 steps, a failure every 45-75 min: TorchPass 405 min,
checkpoint restart 818 min, torchft 930 min) and says how far it lands from it.

The model (first order, kept simple on purpose):

* failures form a Poisson process of rate λ = GPUs × the per-GPU rate (Llama 3: 419 unexpected
  interruptions in 54 days on 16,384 GPUs); failures are independent, one at a time, and a failure can
  strike during a recovery or a redo as well (so λ counts over the whole wall time);
* each failure costs a mean **downtime** D (no rank trains) plus the mean **work redone** W; each step
  costs its step time t plus a steady **overhead** o (checkpoints, snapshots, quorum); then the expected
  wall time of a job of N steps is ``T = N (t + o) / (1 - λ (D + W))`` and goodput = ``N t / T``
  (no finite T when λ (D + W) >= 1: the job never gets ahead of its failures);
* in place (hyperpodrun): D = detection + NCCL teardown + re-forming the group (rendezvous, linear in the
  nodes as measured, and NCCL init, growing with log2 of the GPUs) + hydrating the failed rank's state from
  its peer's in-memory snapshot; W = half the snapshot interval, the interval being the smallest whose
  snapshots cost at most a budget (2 %) of the step time, or Young's for the MTBF where longer, as
  ``--snapshot-every auto`` picks it given the job's MTBF;
* checkpoint restart: D = detection + process restart + rendezvous + NCCL init + loading the checkpoint at
  the storage bandwidth per GPU; W = half the checkpoint interval; o = the synchronous checkpoint write
  over the interval, chosen by Young/Daly: τ = sqrt(2 C M) for write cost C and MTBF M = 1/λ;
* torchft-like: o = a per-step quorum; a failure stalls the survivors for detection + the quorum timeout
  and loses the step in flight; the failed replica group restarts and heals from a peer while the others
  train, which costs its share (1/R of R groups) of that time;
* weak scaling: the state per GPU and the step time do not change with the number of GPUs; hot spares
  are at hand (no wait for a scheduler or a replacement node) for every strategy.

    python benchmarks/goodput_model.py [--quick | --smoke] [--out DIR]

Every mode runs the same computation (it takes milliseconds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, SUMMARY_SUBDIR, BenchmarkError, BenchmarkResult, format_table, parse_args, pyplot
from elastic_events.rounds.snapshot_interval import choose_interval

NAME = "goodput_model"
IN_PLACE, RESTART, TORCHFT = "in-place", "checkpoint-restart", "torchft-like"
STRATEGIES = (IN_PLACE, RESTART, TORCHFT)
GPUS = (64, 256, 1024, 4096, 16384)
GB = 1e9
DAY_S = 86400.0

#: Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected interruptions in a
#: 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
LLAMA3_RATE_PER_GPU_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * DAY_S * LLAMA3_GPUS)

#: Clockwork, "Keeping Distributed Training Running Through Failures" (2026): TorchTitan Llama-4 Scout (109B
#: MoE) on 64 H200 (8 nodes x 8), 3,000 steps, a checkpoint every 100 steps, a failure injected every
#: 2,700-4,500 s; minutes to reach step 3,000.
CLOCKWORK = {
    "gpus": 64,
    "steps": 3000,
    "checkpoint_every_steps": 100,
    "mtbf_min": 60.0,
    "mtbf_range_min": (45.0, 75.0),
    "params": 109e9,
    "published_min": {IN_PLACE: 405.0, RESTART: 818.0, TORCHFT: 930.0},
    "published_as": {IN_PLACE: "TorchPass", RESTART: "checkpoint restart", TORCHFT: "torchft"},
}
#: Assumption: fp32 master weights + AdamW's two fp32 moments (TorchTitan's FSDP default, bf16 compute),
#: 12 bytes per parameter, sharded evenly over the GPUs: 20.4 GB per GPU for Scout on 64 GPUs.
BYTES_PER_PARAM = 12.0


class GoodputModelError(ValueError):
    """An input of the model is out of its range; ``field`` names it."""

    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"{field} {why}, got {value!r}")
        self.field = field
        self.value = value


def _number(owner: str, name: str, value: object, *, positive: bool = False, integer: bool = False) -> None:
    """Raise :class:`GoodputModelError` unless ``value`` is a finite number, >= 0 (or > 0 with ``positive``)."""
    field = f"{owner}.{name}"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise GoodputModelError(field, value, "must be an integer" if integer else "must be a number")
    if not math.isfinite(value):
        raise GoodputModelError(field, value, "must be finite")
    if positive and value <= 0:
        raise GoodputModelError(field, value, "must be > 0")
    if value < 0:
        raise GoodputModelError(field, value, "must be >= 0")


def _validate(obj: Any, *, positive: Sequence[str] = (), integer: Sequence[str] = ()) -> None:
    """Every field of a dataclass is a finite number >= 0; those named are > 0 / integers."""
    for f in dataclasses.fields(obj):
        if f.type in ("str", str):
            continue
        _number(
            type(obj).__name__, f.name, getattr(obj, f.name), positive=f.name in positive, integer=f.name in integer
        )


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """A training job: ``gpus`` GPUs, ``steps`` steps of ``step_time_s``, ``state_bytes_per_gpu`` to restore."""

    gpus: int
    steps: int
    step_time_s: float
    state_bytes_per_gpu: float
    failure_rate_per_gpu_s: float

    def __post_init__(self) -> None:
        _validate(self, positive=("gpus", "steps", "step_time_s"), integer=("gpus", "steps"))

    @property
    def failures_per_s(self) -> float:
        return self.gpus * self.failure_rate_per_gpu_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """Per-event costs and bandwidths: measured ones read by :func:`load_measured`, the rest assumptions."""

    detect_s: float  # failure to the launcher's first record of it (measured, CPU)
    teardown_s: float  # NCCL abort of the broken communicators, overlapped (measured, H100)
    nccl_init_base_s: float  # first NCCL init of a process (measured, H100, world 1)
    nccl_init_per_doubling_s: float  # assumption: growth of NCCL init with log2(GPUs)
    rendezvous_ref_s: float  # time until every node knows its rank at rendezvous_ref_nodes (measured, CPU)
    rendezvous_ref_nodes: int
    gpus_per_node: int
    snapshot_gb_s: float  # hyperpodrun's snapshot chain, GPU -> host -> ring peer (measured, H100)
    snapshot_budget: float  # --snapshot-every auto: snapshots cost at most this share of the step time
    step_check_s: float  # elastic_event_detected() per step (measured, CPU)
    process_restart_s: float  # assumption: restart of every training process to its first step, no load
    storage_aggregate_gb_s: float  # assumption: a real cluster's file system, sustained
    storage_per_gpu_gb_s: float  # assumption: what one GPU's share of a node's storage path reaches
    quorum_s: float  # assumption: torchft's per-step quorum, not hidden behind the backward pass
    quorum_timeout_s: float  # assumption: torchft lighthouse drops a replica group after this silence
    gpus_per_replica_group: int  # assumption: torchft's failure domain

    def __post_init__(self) -> None:
        _validate(
            self,
            positive=(
                "rendezvous_ref_nodes",
                "gpus_per_node",
                "snapshot_gb_s",
                "storage_aggregate_gb_s",
                "storage_per_gpu_gb_s",
                "gpus_per_replica_group",
            ),
            integer=("rendezvous_ref_nodes", "gpus_per_node", "gpus_per_replica_group"),
        )
        if self.snapshot_budget <= 0 or self.snapshot_budget >= 1:
            raise GoodputModelError("Cluster.snapshot_budget", self.snapshot_budget, "must be in (0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyCost:
    """What a strategy costs: per failure (downtime, work redone) and per step (overhead), in seconds."""

    strategy: str
    downtime_s: float
    redo_s: float
    overhead_per_step_s: float
    parts: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise GoodputModelError("StrategyCost.strategy", self.strategy, f"must be one of {STRATEGIES}")
        for name in ("downtime_s", "redo_s", "overhead_per_step_s"):
            _number("StrategyCost", name, getattr(self, name))

    @property
    def per_failure_s(self) -> float:
        return self.downtime_s + self.redo_s


# --------------------------------------------------------------------------- the model


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 C M) (Daly's first-order form)."""
    _number("young_daly_interval_s", "checkpoint_cost_s", checkpoint_cost_s, positive=True)
    _number("young_daly_interval_s", "mtbf_s", mtbf_s, positive=True)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def expected_wall_time_s(*, steps: int, step_time_s: float, failures_per_s: float, cost: StrategyCost) -> float:
    """``steps (t + o) / (1 - λ (D + W))``; ``inf`` when failures come faster than they are repaired."""
    _number("expected_wall_time_s", "steps", steps, positive=True, integer=True)
    _number("expected_wall_time_s", "step_time_s", step_time_s, positive=True)
    _number("expected_wall_time_s", "failures_per_s", failures_per_s)
    lost_share = failures_per_s * cost.per_failure_s
    if lost_share >= 1.0:
        return math.inf
    return steps * (step_time_s + cost.overhead_per_step_s) / (1.0 - lost_share)


def goodput(job: Job, cost: StrategyCost) -> float:
    """Useful time / expected wall time (0 when the job never finishes)."""
    wall = expected_wall_time_s(
        steps=job.steps, step_time_s=job.step_time_s, failures_per_s=job.failures_per_s, cost=cost
    )
    return 0.0 if math.isinf(wall) else job.steps * job.step_time_s / wall


def nccl_init_s(gpus: int, cluster: Cluster) -> float:
    return cluster.nccl_init_base_s + cluster.nccl_init_per_doubling_s * math.log2(max(gpus, 1))


def rendezvous_s(gpus: int, cluster: Cluster) -> float:
    """Linear in the nodes from the largest measured rendezvous (store operations per node were flat)."""
    nodes = max(1, math.ceil(gpus / cluster.gpus_per_node))
    return cluster.rendezvous_ref_s * nodes / cluster.rendezvous_ref_nodes


def storage_gb_s_per_gpu(gpus: int, cluster: Cluster) -> float:
    return min(cluster.storage_per_gpu_gb_s, cluster.storage_aggregate_gb_s / gpus)


def snapshot_every(job: Job, cluster: Cluster) -> int:
    """The snapshot interval (steps) ``--snapshot-every auto`` picks: hyperpodrun's own ``choose_interval``.

    The smallest interval whose snapshots cost at most the budget of the step time, or Young's interval
    for the job's MTBF where that is longer (the job is assumed to give ``ElasticConfig.mtbf_s``).
    """
    cost_s = job.state_bytes_per_gpu / GB / cluster.snapshot_gb_s
    mtbf_s = 1.0 / job.failures_per_s if job.failures_per_s > 0 else None
    return choose_interval(cost_s=cost_s, step_s=job.step_time_s, target=cluster.snapshot_budget, mtbf_s=mtbf_s).every


def in_place_cost(job: Job, cluster: Cluster) -> StrategyCost:
    snapshot_s = job.state_bytes_per_gpu / GB / cluster.snapshot_gb_s
    every = snapshot_every(job, cluster)
    parts = {
        "detect_s": cluster.detect_s,
        "teardown_s": cluster.teardown_s,
        "rendezvous_s": rendezvous_s(job.gpus, cluster),
        "nccl_init_s": nccl_init_s(job.gpus, cluster),
        "hydration_s": snapshot_s,  # the failed rank's shard back from its peer, the chain's path and bandwidth
        "snapshot_every_steps": float(every),
    }
    downtime = sum(v for k, v in parts.items() if k != "snapshot_every_steps")
    return StrategyCost(
        strategy=IN_PLACE,
        downtime_s=downtime,
        redo_s=every * job.step_time_s / 2.0,
        overhead_per_step_s=snapshot_s / every + cluster.step_check_s,
        parts=parts,
    )


def checkpoint_restart_cost(job: Job, cluster: Cluster, *, every_steps: int | None = None) -> StrategyCost:
    """Restart from the last checkpoint; the interval is Young/Daly's unless ``every_steps`` gives it."""
    io_s = job.state_bytes_per_gpu / GB / storage_gb_s_per_gpu(job.gpus, cluster)  # write = read, per GPU
    if every_steps is None:
        mtbf = 1.0 / job.failures_per_s if job.failures_per_s > 0 else math.inf
        interval = young_daly_interval_s(io_s, mtbf) if math.isfinite(mtbf) and io_s > 0 else math.inf
        every_steps = job.steps if math.isinf(interval) else max(1, round(interval / job.step_time_s))
    else:
        _number("checkpoint_restart_cost", "every_steps", every_steps, positive=True, integer=True)
    parts = {
        "detect_s": cluster.detect_s,
        "process_restart_s": cluster.process_restart_s,
        "rendezvous_s": rendezvous_s(job.gpus, cluster),
        "nccl_init_s": nccl_init_s(job.gpus, cluster),
        "checkpoint_load_s": io_s,
        "checkpoint_every_steps": float(every_steps),
        "checkpoint_write_s": io_s,
    }
    downtime = sum(parts[k] for k in ("detect_s", "process_restart_s", "rendezvous_s", "nccl_init_s"))
    return StrategyCost(
        strategy=RESTART,
        downtime_s=downtime + io_s,
        redo_s=every_steps * job.step_time_s / 2.0,
        overhead_per_step_s=io_s / every_steps,
        parts=parts,
    )


def torchft_cost(job: Job, cluster: Cluster) -> StrategyCost:
    groups = max(1, job.gpus // cluster.gpus_per_replica_group)
    group_gpus = min(job.gpus, cluster.gpus_per_replica_group)
    heal_s = job.state_bytes_per_gpu / GB / cluster.snapshot_gb_s  # from a peer group, at hydration's bandwidth
    group_out_s = cluster.process_restart_s + nccl_init_s(group_gpus, cluster) + heal_s
    parts = {
        "detect_s": cluster.detect_s,
        "quorum_timeout_s": cluster.quorum_timeout_s,
        "replica_groups": float(groups),
        "group_out_s": group_out_s,
        "group_out_share_s": group_out_s / groups,
    }
    return StrategyCost(
        strategy=TORCHFT,
        downtime_s=cluster.detect_s + cluster.quorum_timeout_s + group_out_s / groups,
        redo_s=job.step_time_s,  # the step the failure hit is not committed
        overhead_per_step_s=cluster.quorum_s,
        parts=parts,
    )


COSTS: dict[str, Callable[[Job, Cluster], StrategyCost]] = {
    IN_PLACE: in_place_cost,
    RESTART: checkpoint_restart_cost,
    TORCHFT: torchft_cost,
}


def projected_job(
    gpus: int,
    *,
    step_time_s: float,
    state_bytes_per_gpu: float,
    failure_rate_per_gpu_s: float = LLAMA3_RATE_PER_GPU_S,
    steps: int = 3000,
) -> Job:
    """The projection's job at ``gpus`` GPUs: weak scaling, the same step time and state per GPU at every size."""
    return Job(
        gpus=gpus,
        steps=steps,
        step_time_s=step_time_s,
        state_bytes_per_gpu=state_bytes_per_gpu,
        failure_rate_per_gpu_s=failure_rate_per_gpu_s,
    )


def project(
    cluster: Cluster,
    *,
    step_time_s: float,
    state_bytes_per_gpu: float,
    gpus: Sequence[int] = GPUS,
    failure_rate_per_gpu_s: float = LLAMA3_RATE_PER_GPU_S,
) -> list[dict[str, Any]]:
    """Goodput, failures per day and MTBF for each size and strategy."""
    rows = []
    for n in gpus:
        job = projected_job(
            n,
            step_time_s=step_time_s,
            state_bytes_per_gpu=state_bytes_per_gpu,
            failure_rate_per_gpu_s=failure_rate_per_gpu_s,
        )
        for strategy in STRATEGIES:
            cost = COSTS[strategy](job, cluster)
            rate = job.failures_per_s
            rows.append(
                {
                    "gpus": n,
                    "strategy": strategy,
                    "goodput": round(goodput(job, cost), 6),
                    "failures_per_day": float(f"{rate * DAY_S:.4g}"),
                    "mtbf_min": round(1.0 / rate / 60.0, 1) if rate > 0 else None,
                    "downtime_s": round(cost.downtime_s, 2),
                    "redo_s": round(cost.redo_s, 2),
                    "overhead_per_step_s": round(cost.overhead_per_step_s, 4),
                }
            )
    return rows


# --------------------------------------------------------------------------- Clockwork


def clockwork_job(step_time_s: float, *, mtbf_min: float = CLOCKWORK["mtbf_min"]) -> Job:
    gpus = CLOCKWORK["gpus"]
    return Job(
        gpus=gpus,
        steps=CLOCKWORK["steps"],
        step_time_s=step_time_s,
        state_bytes_per_gpu=CLOCKWORK["params"] * BYTES_PER_PARAM / gpus,
        failure_rate_per_gpu_s=1.0 / (mtbf_min * 60.0 * gpus),
    )


def clockwork_cost(strategy: str, job: Job, cluster: Cluster) -> StrategyCost:
    if strategy == RESTART:  # the published run checkpointed every 100 steps, not at Young/Daly's interval
        return checkpoint_restart_cost(job, cluster, every_steps=CLOCKWORK["checkpoint_every_steps"])
    return COSTS[strategy](job, cluster)


def derive_clockwork_step_time(cluster: Cluster, *, iterations: int = 100) -> float:
    """The step time at which the in-place model takes TorchPass's published 405 min at a 60 min MTBF.

    Fixed point of t = (T_pub (1 - λ (D + W(t))) / N) - o(t): the fastest run's time less its modelled
    failure costs and overheads, per step. The in-place ratio is then 1 by construction.
    """
    wall = CLOCKWORK["published_min"][IN_PLACE] * 60.0
    t = wall / CLOCKWORK["steps"]
    for _ in range(iterations):
        job = clockwork_job(t)
        cost = in_place_cost(job, cluster)
        new = wall * (1.0 - job.failures_per_s * cost.per_failure_s) / job.steps - cost.overhead_per_step_s
        if new <= 0:
            raise BenchmarkError("no step time reproduces TorchPass's 405 min: the in-place failure costs exceed it")
        if abs(new - t) < 1e-9:
            break
        t = new
    return t


def clockwork_comparison(cluster: Cluster, step_time_s: float) -> list[dict[str, Any]]:
    """Model against published minutes per strategy, at a 60 min MTBF and at 45 and 75 min."""
    rows = []
    lo, hi = CLOCKWORK["mtbf_range_min"]
    for strategy in STRATEGIES:
        published = CLOCKWORK["published_min"][strategy]

        def minutes(mtbf_min: float, strategy: str = strategy) -> float:
            job = clockwork_job(step_time_s, mtbf_min=mtbf_min)
            cost = clockwork_cost(strategy, job, cluster)
            kw = {"steps": job.steps, "step_time_s": job.step_time_s, "failures_per_s": job.failures_per_s}
            return expected_wall_time_s(**kw, cost=cost) / 60.0

        job = clockwork_job(step_time_s)
        cost = clockwork_cost(strategy, job, cluster)
        model = minutes(CLOCKWORK["mtbf_min"])
        steady_s = job.steps * (job.step_time_s + cost.overhead_per_step_s)
        # what one failure would have to cost for the published time, the step time and overheads as modelled
        implied_per_failure_s = (1.0 - steady_s / (published * 60.0)) / job.failures_per_s
        # what each step would have to cost for the published time, the failure costs as modelled
        implied_step_s = published * 60.0 * (1.0 - job.failures_per_s * cost.per_failure_s) / job.steps
        rows.append(
            {
                "strategy": strategy,
                "published_as": CLOCKWORK["published_as"][strategy],
                "model_min": round(model, 1),
                "model_min_at_mtbf_45": round(minutes(lo), 1),
                "model_min_at_mtbf_75": round(minutes(hi), 1),
                "published_min": published,
                "ratio": round(model / published, 3),
                "model_per_failure_s": round(cost.per_failure_s, 1),
                "implied_per_failure_s": round(implied_per_failure_s, 1),
                "model_step_with_overhead_s": round(job.step_time_s + cost.overhead_per_step_s, 3),
                "implied_step_with_overhead_s": round(implied_step_s, 3),
            }
        )
    return rows


# --------------------------------------------------------------------------- measured inputs


GPU_CHECK_DIR = RESULTS_DIR / "gpu" / "2026-11-26-h100"


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"cannot read the measured input {path}: {e}") from None


def _rel(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it."""
    root = RESULTS_DIR.parent.parent
    return path.relative_to(root) if path.is_relative_to(root) else path


def _dig(doc: Mapping[str, Any], path: str, *keys: str) -> Any:
    value: Any = doc
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            raise BenchmarkError(f"{path}: no {'.'.join(keys)}")
        value = value[key]
    return value


def load_measured(summary_dir: Path = RESULTS_DIR / SUMMARY_SUBDIR, gpu_dir: Path = GPU_CHECK_DIR) -> dict[str, Any]:
    """The measured inputs, each ``{"value": ..., "source": ...}``, from the committed result files."""
    out: dict[str, Any] = {}

    def take(name: str, file: Path, *keys: str, unit: str = "") -> float:
        value = float(_dig(_read(file), str(file), *keys))
        out[name] = {"value": value, "source": f"{_rel(file)}: {'.'.join(keys)}", **({"unit": unit} if unit else {})}
        return value

    failures = summary_dir / "failures_quick.json"
    fsdp = summary_dir / "failures_fsdp_quick.json"
    for kind in ("rank_crash", "node_loss"):
        take(f"cpu_{kind}_detect_s", failures, "summary", "by_kind", kind, "hyperpodrun", "detect_median_s")
        take(
            f"cpu_{kind}_in_place_downtime_s", failures, "summary", "by_kind", kind, "hyperpodrun", "downtime_median_s"
        )
        take(
            f"cpu_{kind}_restart_downtime_s",
            failures,
            "summary",
            "by_kind",
            kind,
            "hyperpodrun-restart",
            "downtime_median_s",
        )
        take(
            f"cpu_{kind}_restart_steps_lost",
            failures,
            "summary",
            "by_kind",
            kind,
            "hyperpodrun-restart",
            "steps_lost_median",
        )
        take(
            f"cpu_fsdp_{kind}_in_place_steps_lost", fsdp, "summary", "by_kind", kind, "hyperpodrun", "steps_lost_median"
        )
    take("cpu_hydration_gb_s", summary_dir / "hydration_quick.json", "summary", "hydration_mb_per_s")
    out["cpu_hydration_gb_s"]["value"] /= 1000.0
    take("cpu_step_check_us", summary_dir / "step_overhead_quick.json", "summary", "check_inside_median_us")
    rdzv = summary_dir / "rendezvous_scale_quick.json"
    largest = int(_dig(_read(rdzv), str(rdzv), "summary", "embedded", "largest_n_completed"))
    take("cpu_rendezvous_s_at_largest_n", rdzv, "summary", "embedded", "time_to_all_ranks_s", str(largest))
    out["cpu_rendezvous_s_at_largest_n"]["nodes"] = largest
    take("cpu_dcp_save_gb_s", summary_dir / "checkpoint_quick.json", "summary", "synthetic-50MB", "dcp_save_gbps")
    after = gpu_dir / "gpu_check_after_engine_summary.json"
    take("h100_nccl_abort_teardown_s", after, "B1", "broken", "teardown_median_s")
    take("h100_nccl_destroy_teardown_s", after, "B1", "graceful", "teardown_median_s")
    take("h100_nccl_first_init_s", after, "B1", "graceful", "init_first_s")
    take("h100_d2h_pinned_gb_s", after, "P", "d2h_gb_s")
    first = gpu_dir / "gpu_check_summary.json"
    doc = _read(first)
    rank0 = _dig(doc, str(first), "B2", "ranks")[0]
    for key in ("chain_gb_s", "state_gb", "d2h_pinned_gb_s"):
        value = float(_dig(rank0, str(first), key))
        out[f"h100_snapshot_{key}"] = {"value": value, "source": f"{_rel(first)}: B2.ranks[0].{key}"}
    return out


def cluster_from(measured: Mapping[str, Any]) -> tuple[Cluster, list[str]]:
    """The cluster the projection uses, and one line per assumption (what it is and why that value)."""
    m = {k: v["value"] for k, v in measured.items()}
    assumptions = [
        f"Failure rate per GPU from Llama 3: {LLAMA3_INTERRUPTIONS} unexpected interruptions in {LLAMA3_DAYS} days "
        f"on {LLAMA3_GPUS:,} GPUs = {LLAMA3_RATE_PER_GPU_S:.3e} per GPU-second (every interruption stops a "
        "synchronous job); failures are a Poisson process, independent, one at a time.",
        "Weak scaling: the state per GPU (Scout's, see below) and the step time (derived from Clockwork's TorchPass "
        "run) are the same at every size; hot spares are at hand for every strategy (no scheduler or "
        "node-replacement wait).",
        f"State per GPU: {BYTES_PER_PARAM:g} bytes per parameter (fp32 weights + AdamW's two fp32 moments, "
        f"TorchTitan's FSDP default), Scout's {CLOCKWORK['params'] / 1e9:g}B parameters over "
        f"{CLOCKWORK['gpus']} GPUs = {CLOCKWORK['params'] * BYTES_PER_PARAM / CLOCKWORK['gpus'] / GB:.1f} GB.",
        "Detection: the larger of the measured rank-crash and node-loss detection medians (CPU; a hang would add "
        "--hang-timeout).",
        "NCCL teardown: the measured abort of the broken communicators on one H100 (0.99 s, overlapped across "
        "communicators), taken as independent of the number of GPUs.",
        "NCCL init: the measured first init on one H100 plus 0.5 s per doubling of the GPUs (assumption: NCCL's "
        "bootstrap grows with log2 N; not measured here, one GPU only): 7.4 s at 16,384 GPUs.",
        f"Rendezvous: linear in the nodes ({8} GPUs a node) from the largest measured size (embedded store, "
        "store operations per node flat; the measurement shares 2 CPUs between all simulated nodes, so this is "
        "pessimistic).",
        "In-place hydration and torchft's heal: the failed rank's state at the measured snapshot chain bandwidth "
        "(1.79 GB/s, GPU -> pinned host -> ring peer on one H100); snapshots every k steps, k the smallest whose "
        "snapshots (state / 1.79 GB/s each, no overlap with the step credited) cost <= 2 % of the step time, "
        "or Young's interval for the MTBF where longer (--snapshot-every auto with ElasticConfig.mtbf_s given, "
        "hyperpodrun's own choose_interval); redo = k/2 steps on average.",
        "Process restart for checkpoint restart and for torchft's failed replica group: 120 s to the first step "
        "before the checkpoint load (assumption: process start, import torch, CUDA context, model build and "
        "compile on a GPU node; the CPU restart path here took "
        f"{m['cpu_rank_crash_restart_downtime_s']:.1f} s in all with a tiny model; Clockwork's own sizing page "
        "assumes 15 min).",
        "Checkpoint storage: min(2 GB/s per GPU, 2 TB/s / GPUs) for writes and reads (assumption: 2 TB/s is the "
        "sustained throughput of Meta's Tectonic store for Llama 3; 2 GB/s per GPU is a 16 GB/s node client; "
        f"DCP on this machine's local disk reached {m['cpu_dcp_save_gb_s']:.2f} GB/s). Checkpoints are "
        "synchronous (the write stops training); async checkpointing would shrink the write cost.",
        "Checkpoint interval: Young/Daly's sqrt(2 C M) in the projection (C = write time, M = MTBF), rounded to "
        "whole steps; 100 steps in the Clockwork check, as published.",
        "torchft-like: 0.1 s per step of quorum not hidden behind the backward pass (assumption; torchft "
        "overlaps it, Clockwork calls it negligible for steps of seconds), 1 s for the lighthouse to drop a "
        "silent group (torchft issue #35: heartbeats every 100 ms, a 1 s timeout), replica groups of 16 GPUs "
        "(2 nodes: Scout's 1.3 TB of state needs more than one node's HBM); the step a failure hits is redone; "
        "a failed group's restart + heal costs its 1/R share; the Gloo cross-replica all-reduce Clockwork "
        "blames for torchft's time is not modelled.",
        "Clockwork step time: derived, not published: the step time at which the in-place model takes "
        "TorchPass's 405 min at a 60 min MTBF (TorchPass modelled as hyperpodrun's in-place repair), so the "
        "in-place ratio is 1 by construction and only the other two strategies test the model.",
    ]
    cluster = Cluster(
        detect_s=max(m["cpu_rank_crash_detect_s"], m["cpu_node_loss_detect_s"]),
        teardown_s=m["h100_nccl_abort_teardown_s"],
        nccl_init_base_s=m["h100_nccl_first_init_s"],
        nccl_init_per_doubling_s=0.5,
        rendezvous_ref_s=m["cpu_rendezvous_s_at_largest_n"],
        rendezvous_ref_nodes=int(measured["cpu_rendezvous_s_at_largest_n"]["nodes"]),
        gpus_per_node=8,
        snapshot_gb_s=m["h100_snapshot_chain_gb_s"],
        snapshot_budget=0.02,
        step_check_s=m["cpu_step_check_us"] * 1e-6,
        process_restart_s=120.0,
        storage_aggregate_gb_s=2000.0,
        storage_per_gpu_gb_s=2.0,
        quorum_s=0.1,
        quorum_timeout_s=1.0,
        gpus_per_replica_group=16,
    )
    return cluster, assumptions


# --------------------------------------------------------------------------- driver


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for strategy, style in zip(STRATEGIES, ("o-", "s--", "^:")):
        mine = [r for r in rows if r["strategy"] == strategy]
        ax.plot([r["gpus"] for r in mine], [r["goodput"] for r in mine], style, label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (Llama 3 failure rate per GPU)")
    ax.set_ylabel("projected goodput")
    ax.set_ylim(top=1.0)
    ax.set_title("Goodput model (first order, weak scaling)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(__doc__.splitlines()[0], argv=argv)
    measured = load_measured()
    cluster, assumptions = cluster_from(measured)
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=ns.tag,
        params={
            "gpus": list(GPUS),
            "strategies": list(STRATEGIES),
            "cluster": dataclasses.asdict(cluster),
            "clockwork": {k: v for k, v in CLOCKWORK.items()},
            "bytes_per_param": BYTES_PER_PARAM,
        },
        baseline="Clockwork's published side-by-side run (Llama-4 Scout, 64 H200, 3,000 steps, a failure every "
        "45-75 min: TorchPass 405 min, checkpoint restart 818 min, torchft 930 min)",
    )
    step_s = derive_clockwork_step_time(cluster)
    state = CLOCKWORK["params"] * BYTES_PER_PARAM / CLOCKWORK["gpus"]
    rows = project(cluster, step_time_s=step_s, state_bytes_per_gpu=state)
    check = clockwork_comparison(cluster, step_s)
    parts = {
        str(n): {
            s: dict(COSTS[s](projected_job(n, step_time_s=step_s, state_bytes_per_gpu=state), cluster).parts)
            for s in STRATEGIES
        }
        for n in (GPUS[0], GPUS[-1])
    }
    by = {(r["gpus"], r["strategy"]): r for r in rows}
    result.summary = {
        "step_time_s": round(step_s, 3),
        "state_gb_per_gpu": round(state / GB, 2),
        **{f"clockwork_ratio_{c['strategy'].replace('-', '_')}": c["ratio"] for c in check},
        **{
            f"goodput_{n}_{s.replace('-', '_')}": by[(n, s)]["goodput"] for n in (GPUS[0], GPUS[-1]) for s in STRATEGIES
        },
        "projection": rows,
        "clockwork": check,
        "inputs": measured,
        "assumptions": assumptions,
    }
    result.samples = {"cost_parts": parts}
    result.notes = [
        "A first-order model, not a measurement: see assumptions; every per-event cost not measured here is a "
        "named parameter of Cluster in benchmarks/goodput_model.py.",
        *(
            f"Clockwork, {c['published_as']} as {c['strategy']}: model {c['model_min']:.0f} min "
            f"({c['model_min_at_mtbf_45']:.0f}-{c['model_min_at_mtbf_75']:.0f} min for a failure every 45-75 min) "
            f"against {c['published_min']:.0f} min published, ratio {c['ratio']:.2f} "
            f"({abs(1 - c['ratio']) * 100:.0f} % {'short' if c['ratio'] < 1 else 'over'}); the published time "
            f"implies {c['implied_per_failure_s'] / 60:.1f} min per failure (model {c['model_per_failure_s'] / 60:.1f}) "
            f"or {c['implied_step_with_overhead_s']:.1f} s per step (model {c['model_step_with_overhead_s']:.1f})."
            + (" 1 by construction: the step time is derived from this run." if c["strategy"] == IN_PLACE else "")
            for c in check
        ),
        *assumptions,
    ]
    plot(rows, result.plot_path(ns.out))
    path = result.write(ns.out)
    print(
        format_table(
            ["GPUs", "strategy", "goodput", "failures/day", "MTBF min", "downtime s", "redo s", "overhead s/step"],
            [
                [
                    r["gpus"],
                    r["strategy"],
                    r["goodput"],
                    r["failures_per_day"],
                    r["mtbf_min"],
                    r["downtime_s"],
                    r["redo_s"],
                    r["overhead_per_step_s"],
                ]
                for r in rows
            ],
        )
    )
    print()
    print(f"Clockwork check (step time {step_s:.2f} s, derived from TorchPass's 405 min):")
    print(
        format_table(
            ["strategy", "model min", "MTBF 45-75 min", "published min", "ratio", "implied min/failure"],
            [
                [
                    c["strategy"],
                    c["model_min"],
                    f"{c['model_min_at_mtbf_45']:.0f}-{c['model_min_at_mtbf_75']:.0f}",
                    c["published_min"],
                    c["ratio"],
                    round(c["implied_per_failure_s"] / 60, 1),
                ]
                for c in check
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
