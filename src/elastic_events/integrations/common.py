"""Framework-independent parts of the integrations: global batch, resume markers, RNG.

Nothing here imports a training framework.

* :func:`accumulation_steps` plans the gradient accumulation that keeps the global
  batch (per-device batch x accumulation x world size) constant at the current
  world size, and names the world sizes that cannot keep it.
* A checkpoint is *complete* once every rank has finished writing it: the
  integrations then write a small JSON marker next to it (rank 0, after a barrier,
  atomically). :func:`write_marker` / :func:`read_marker` / :func:`newest_marked`
  implement that; the marker also records the world size and global batch of the
  save, so a resume at another size knows that it is one.
* :func:`reseed_rank` gives a rank whose random stream has no predecessor (the
  world size changed) a stream derived from ``(seed, step, rank)``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ElasticIntegrationError",
    "GlobalBatchError",
    "ResumeMarker",
    "accumulation_steps",
    "newest_marked",
    "read_marker",
    "reseed_rank",
    "world_sizes_keeping",
    "write_marker",
]

MARKER_VERSION = 1


class ElasticIntegrationError(RuntimeError):
    """A framework integration is configured in a way that cannot resume elastically."""


class GlobalBatchError(ElasticIntegrationError, ValueError):
    """The global batch cannot be kept constant at some world size."""


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GlobalBatchError(f"{name} must be a positive int, got {value!r}")
    return value


def world_sizes_keeping(*, global_batch: int, per_device_batch: int, up_to: int) -> list[int]:
    """World sizes ``1..up_to`` at which ``global_batch`` is a whole number of per-device batches per rank."""
    _positive("global_batch", global_batch)
    _positive("per_device_batch", per_device_batch)
    return [w for w in range(1, up_to + 1) if global_batch % (per_device_batch * w) == 0]


def accumulation_steps(
    *,
    global_batch: int,
    per_device_batch: int,
    world_size: int,
    world_sizes: Iterable[int] = (),
) -> int:
    """Gradient accumulation steps so that ``per_device_batch * steps * world_size == global_batch``.

    ``world_sizes``: other sizes the job may take (e.g. every multiple of
    ``--nproc-per-node`` between the ``--nnodes`` bounds); each one is checked too,
    so a job learns at its first start, not at its first scale event, which
    sizes could not keep the global batch.

    Raises :class:`GlobalBatchError` naming every size that cannot keep it and the
    sizes up to the largest one asked about that can.
    """
    _positive("global_batch", global_batch)
    _positive("per_device_batch", per_device_batch)
    _positive("world_size", world_size)
    sizes = sorted({world_size, *(_positive("world_sizes[...]", w) for w in world_sizes)})
    bad = [w for w in sizes if global_batch % (per_device_batch * w)]
    if bad:
        good = world_sizes_keeping(global_batch=global_batch, per_device_batch=per_device_batch, up_to=max(sizes))
        raise GlobalBatchError(
            f"global batch {global_batch} cannot be kept at world size {', '.join(map(str, bad))} with "
            f"per-device batch {per_device_batch}: {global_batch} is not a multiple of {per_device_batch} x world "
            f"size; world sizes up to {max(sizes)} that keep it: {', '.join(map(str, good)) or 'none'}"
        )
    return global_batch // (per_device_batch * world_size)


@dataclass(frozen=True, kw_only=True)
class ResumeMarker:
    """What a complete elastic checkpoint records about the job that saved it."""

    step: int  # optimizer steps trained when it was saved
    world_size: int
    global_batch: int
    seed: int
    version: int = MARKER_VERSION


def write_marker(path: Path, marker: ResumeMarker) -> None:
    """Write ``marker`` atomically (call on one rank, after every rank finished saving)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(marker)))
    os.replace(tmp, path)


def read_marker(path: Path) -> ResumeMarker | None:
    """The marker at ``path``, or None if there is none (an incomplete or foreign checkpoint)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ElasticIntegrationError(f"elastic checkpoint marker {path} is not JSON: {exc}") from None
    try:
        marker = ResumeMarker(**data)
    except TypeError as exc:
        raise ElasticIntegrationError(f"elastic checkpoint marker {path} is malformed: {exc}") from None
    if marker.version != MARKER_VERSION:
        raise ElasticIntegrationError(
            f"elastic checkpoint marker {path} has version {marker.version}, expected {MARKER_VERSION}"
        )
    return marker


def newest_marked(directory: Path, pattern: str, marker_name: str) -> Path | None:
    """The entry of ``directory`` matching ``pattern`` (one group: the step) with the highest step
    whose marker (``marker_name`` formatted with ``name``) exists; None when there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    regex = re.compile(pattern)
    found: list[tuple[int, Path]] = []
    for entry in directory.iterdir():
        m = regex.fullmatch(entry.name)
        if m and (directory / marker_name.format(name=entry.name)).is_file():
            found.append((int(m.group(1)), entry))
    return max(found)[1] if found else None


def rank_and_world() -> tuple[int, int]:
    """This rank and the world size: the process group's once it exists, else the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def reseed_rank(seed: int, step: int, rank: int) -> int:
    """Seed Python, NumPy and torch from ``(seed, step, rank)``; returns the derived seed.

    For a resume at a new world size: old ranks' random streams do not map onto new
    ranks, so every rank gets a fresh, deterministic, per-rank stream instead.
    """
    from elastic_events.rng import derive_rank_seed, seed_all

    derived = derive_rank_seed(seed, step, rank)
    seed_all(derived)
    return derived
