"""How the rank side waits and moves state: one configuration for :class:`~elastic_events.ElasticTraining`
and the framework integrations, and the default wrapper of a replicated model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_events.contract import DEFAULT_SNAPSHOT_EVERY, SnapshotEvery, is_snapshot_every, rank_context
from elastic_events.errors import ElasticTrainingError
from elastic_events.rounds.mesh import HSDPConfig

__all__ = ["ElasticConfig", "ElasticConfigError", "default_wrap"]


class ElasticConfigError(ElasticTrainingError, ValueError):
    """An :class:`ElasticConfig` field is invalid."""


_POSITIVE = (
    "timeout_s",
    "admission_timeout_s",
    "recover_timeout_s",
    "poll_s",
    "bucket_mb",
    "collective_timeout_s",
    "collective_timeout_steps",
    "peer_failure_grace_s",
)


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How a rank waits and moves state at scale events and repairs."""

    timeout_s: float = 600.0  # forming a group, hydration and every collective of a round
    admission_timeout_s: float = 86_400.0  # how long a parked joiner waits to be admitted
    recover_timeout_s: float = 60.0  # how long a rank whose collective failed waits for the repaired group
    poll_s: float = 0.005  # a parked joiner's look at the control channel
    bucket_mb: float = 64.0  # largest broadcast of the state transfer
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else cpu
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    # A sharded model's in-memory snapshot (elastic_events.rounds.snapshot) every N steps; 0: none;
    # "auto": the smallest interval whose snapshots cost at most snapshot_overhead of the step time,
    # measured per round (elastic_events.rounds.snapshot_interval). None: the launcher's --snapshot-every
    # (HYPERPODRUN_SNAPSHOT_EVERY), else "auto".
    snapshot_every: SnapshotEvery | None = None
    snapshot_overhead: float = 0.02  # "auto": the share of step time snapshots may cost
    # "auto": the job's mean time between failures, where known (seconds): the interval is then at least
    # Young's, sqrt(2 * snapshot cost * mtbf), which balances snapshot cost against work a failure redoes.
    mtbf_s: float | None = None
    # Freeze what exists when start() begins (the imports: about 290,000 objects with torch) out of the
    # cyclic collector's reach (gc.freeze): the full collections that free a replaced sharded model then
    # scan only what was built since (0.13 s -> 0.03-0.05 s in a sharded repair here), and so do Python's own
    # oldest-generation collections during training. A reference cycle made before start() and dropped
    # later is then never collected; False leaves the collector as it is.
    freeze_gc: bool = True
    # The commit check (elastic_events.rounds.commit): an optimizer step is taken only once the step's
    # collectives completed on the device. False skips it (a step queued behind a broken all-reduce may
    # then be applied on partial gradients).
    commit_check: bool = True
    # How long a step's collectives may take at the commit check before the rank aborts its round:
    # collective_timeout_steps times the step time seen so far, at least collective_timeout_s.
    collective_timeout_s: float = 60.0
    collective_timeout_steps: float = 20.0
    # A RuntimeError from a step that carries no sign of a peer failure (not a c10d error, no repair
    # published, no connection of the round closed): how long to wait for one before raising it as the
    # script's own error. Covers gloo, whose errors are plain RuntimeErrors, while the launcher learns of
    # a lost node (its lease: 10 s by default).
    peer_failure_grace_s: float = 15.0
    # HSDP: a ("replicate", "shard") mesh per round (elastic_events.rounds.mesh), handed to wrap as its mesh=;
    # scale events and repairs move whole replicas' shards (elastic_events.rounds.replica_plan). None: no mesh.
    hsdp: HSDPConfig | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ElasticConfigError(f"ElasticConfig.{name} must be a number > 0, got {value!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ElasticConfigError(f"ElasticConfig.backend must be None, 'gloo' or 'nccl', got {self.backend!r}")
        for name in ("freeze_gc", "commit_check"):
            if not isinstance(getattr(self, name), bool):
                raise ElasticConfigError(f"ElasticConfig.{name} must be True or False, got {getattr(self, name)!r}")
        every = self.snapshot_every
        if every is not None and not is_snapshot_every(every):
            raise ElasticConfigError(
                f"ElasticConfig.snapshot_every must be 'auto' or an integer >= 0 (0: no snapshots), got {every!r}"
            )
        if isinstance(self.snapshot_overhead, bool) or not (
            isinstance(self.snapshot_overhead, (int, float)) and 0 < self.snapshot_overhead < 1
        ):
            raise ElasticConfigError(
                f"ElasticConfig.snapshot_overhead must be a fraction in (0, 1), got {self.snapshot_overhead!r}"
            )
        if self.hsdp is not None and not isinstance(self.hsdp, HSDPConfig):
            raise ElasticConfigError(f"ElasticConfig.hsdp must be None or an HSDPConfig, got {self.hsdp!r}")
        mtbf = self.mtbf_s
        if mtbf is not None and (isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not mtbf > 0):
            raise ElasticConfigError(f"ElasticConfig.mtbf_s must be None or a number > 0, got {mtbf!r}")

    @property
    def snapshot_interval(self) -> SnapshotEvery:
        """Steps between snapshots (0: none) or ``"auto"``: the field, else the launcher's setting, else auto."""
        if self.snapshot_every is not None:
            return self.snapshot_every
        launcher = rank_context().snapshot_every
        return DEFAULT_SNAPSHOT_EVERY if launcher is None else launcher

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


def default_wrap(module: torch.nn.Module, *, init_sync: bool = True) -> torch.nn.Module:
    """DDP over the current group (``device_ids`` on CUDA); the bare model in a single process.

    ``init_sync=False`` skips DDP's broadcast of rank 0's parameters: after a hydration every
    replica is already bitwise the same.
    """
    if not dist.is_initialized():
        return module
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, init_sync=init_sync)
