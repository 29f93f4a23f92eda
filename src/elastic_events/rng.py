"""Random number generator state: capture, restore, and re-derive after a resize.

A rank's generators (Python ``random``, NumPy's global ``RandomState``, torch CPU
and the current CUDA device) are a per-rank stream. At an unchanged world size a
rank restores exactly its own saved stream, so training resumes bit for bit. After
the world size changes there is no meaningful mapping from old ranks' streams to new
ranks (rank 2 of 3 has no predecessor in a world of 2), so every rank is re-seeded
from :func:`derive_rank_seed` ``(base_seed, step, rank)`` instead: deterministic for
a given checkpoint and world size, distinct per rank and per resume step.

Only the global generators are covered; ``torch.Generator`` or
``numpy.random.Generator`` objects owned by user code travel in their owners' state.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "RngState",
    "capture_rng_state",
    "derive_rank_seed",
    "restore_rng_state",
    "rng_from_plain",
    "rng_to_plain",
    "seed_all",
]

_SEED_BITS = 63


@dataclass(frozen=True, kw_only=True)
class RngState:
    """A snapshot of one process's global generators."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    cuda: torch.Tensor | None
    """State of the current CUDA device's default generator; ``None`` when CUDA was not in use."""
    base_seed: int
    """``torch.initial_seed()`` at capture time: the root from which resized jobs re-seed."""


def capture_rng_state() -> RngState:
    """Snapshot the global generators of this process (CUDA only if already initialised)."""
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # a dict only when the global RandomState is not an MT19937
        raise TypeError(
            f"NumPy's global RandomState has no MT19937 state to capture: {numpy_state.get('bit_generator')}"
        )
    return RngState(
        python=random.getstate(),
        numpy=numpy_state,
        torch_cpu=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state() if cuda_in_use else None,
        base_seed=torch.initial_seed(),
    )


def rng_to_plain(state: RngState) -> dict[str, Any]:
    """``state`` as tensors, numbers and tuples only, so it loads with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = state.numpy
    return {
        **vars(state),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)), pos, has_gauss, cached),
    }


def rng_from_plain(plain: dict[str, Any]) -> RngState:
    """The inverse of :func:`rng_to_plain`."""
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    numpy_state = (
        kind,
        np.asarray(keys.numpy() if isinstance(keys, torch.Tensor) else keys, dtype=np.uint32),
        pos,
        has_gauss,
        cached,
    )
    return RngState(**{**plain, "numpy": numpy_state})


def restore_rng_state(state: RngState) -> None:
    """Make the global generators continue exactly where ``state`` was captured."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    if state.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.cuda)


def derive_rank_seed(base_seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that is a pure function of ``(base_seed, step, rank)``.

    Hash-based rather than ``base_seed + rank`` so that neighbouring ranks and
    steps get unrelated streams.
    """
    for name, value in (("base_seed", base_seed), ("step", step), ("rank", rank)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    digest = hashlib.sha256(f"{base_seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
