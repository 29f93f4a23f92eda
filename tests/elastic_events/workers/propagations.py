"""Counting the sharding propagations DTensor computes (its cache's misses), for the workers of the tests."""

from __future__ import annotations

from torch.distributed.tensor._sharding_prop import ShardingPropagator


def count_computed_propagations() -> list[int]:
    """Patch DTensor's propagator in this process to count each propagation it computes rather than finds in its
    cache; returns the counter, a one-element list."""
    computed = [0]
    compute = ShardingPropagator.propagate_op_sharding_non_cached

    def counted(self: ShardingPropagator, *args: object, **kwargs: object) -> object:
        computed[0] += 1
        return compute(self, *args, **kwargs)

    ShardingPropagator.propagate_op_sharding_non_cached = counted  # type: ignore[method-assign]
    return computed
