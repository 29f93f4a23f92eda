"""Whether the model being built is about to have its state loaded over it.

At a scale event or a repair, :class:`~elastic_events.ElasticTraining` rebuilds a sharded model (FSDP2,
HSDP) on the new mesh with the script's ``wrap`` and then overwrites every parameter, persistent buffer
and optimizer state from what the ranks kept: their own shards, another replica's, an in-memory snapshot or
a full state resharded from rank 0. A ``wrap`` that initialises weights randomly (to_empty, then
``init_weights``) may skip the random draw while :func:`state_will_be_loaded` is true: at 125 M parameters
the example's initialisation draws 1.1 s of full-size values on every rank (CPU), all of it thrown away.
Buffers the load does not carry (non-persistent ones) are computed as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["loading_over", "state_will_be_loaded"]

_builds_to_load = 0


def state_will_be_loaded() -> bool:
    """True while ElasticTraining builds a model whose parameters it overwrites right after (see the module)."""
    return _builds_to_load > 0


@contextlib.contextmanager
def loading_over() -> Iterator[None]:
    """Mark the build inside as one whose parameters are loaded right after (:func:`state_will_be_loaded`)."""
    global _builds_to_load
    _builds_to_load += 1
    try:
        yield
    finally:
        _builds_to_load -= 1
