"""The decider's context of a one-node elastic job, for tests that drive an ``ElasticRendezvous`` over a real store."""

from __future__ import annotations

from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.decider import DeciderContext


def one_node_context(*, nproc_per_node: int = 1, max_restarts: int = 1) -> DeciderContext:
    """A job of exactly one node (its first round starts at once), with the launcher's default timers."""
    return DeciderContext(
        policy=ElasticPolicy(min_replicas=1, max_replicas=1),
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        lease_ttl=10.0,
        ack_timeout=30.0,
        propagation=1.0,
        tick=0.2,
    )
