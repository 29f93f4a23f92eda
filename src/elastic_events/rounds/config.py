"""What a user configures of :class:`~elastic_events.training.ElasticTraining`: how it waits and
moves state, and the default wrapper of a replicated model."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_events.contract import SNAPSHOT_EVERY_ENV

__all__ = ["ElasticConfig", "default_wrap"]


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How :class:`ElasticTraining` waits and moves state."""

    timeout_s: float = 600.0  # forming a group, hydration and every collective of a round
    admission_timeout_s: float = 86_400.0  # how long a parked joiner waits to be admitted
    recover_timeout_s: float = 60.0  # how long a rank whose collective failed waits for the repaired group
    poll_s: float = 0.005  # a parked joiner's look at the control channel
    bucket_mb: float = 64.0  # largest broadcast of the state transfer
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else cpu
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    # A sharded model's in-memory snapshot (elastic_events.rounds.snapshot) every N steps; 0: none.
    # None: the launcher's --snapshot-every (HYPERPODRUN_SNAPSHOT_EVERY), else every step.
    snapshot_every: int | None = None
    # Freeze what exists when start() begins (the imports: about 290,000 objects with torch) out of the
    # cyclic collector's reach (gc.freeze): the full collections that free a replaced sharded model then
    # scan only what was built since (0.13 s -> 0.03-0.05 s in a sharded repair here), and so do Python's own
    # oldest-generation collections during training. A reference cycle made before start() and dropped
    # later is then never collected; False leaves the collector as it is.
    freeze_gc: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout_s", "admission_timeout_s", "recover_timeout_s", "poll_s", "bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {self.backend!r}")
        if not isinstance(self.freeze_gc, bool):
            raise ValueError(f"freeze_gc must be True or False, got {self.freeze_gc!r}")
        every = self.snapshot_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise ValueError(f"snapshot_every must be an integer >= 0 (0: no snapshots), got {every!r}")

    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots (0: none): the field, else the launcher's setting, else 1."""
        if self.snapshot_every is not None:
            return self.snapshot_every
        raw = os.environ.get(SNAPSHOT_EVERY_ENV, "1")
        try:
            every = int(raw)
        except ValueError:
            raise ValueError(f"{SNAPSHOT_EVERY_ENV}={raw!r}: expected an integer >= 0") from None
        if every < 0:
            raise ValueError(f"{SNAPSHOT_EVERY_ENV}={raw!r}: expected an integer >= 0")
        return every

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
