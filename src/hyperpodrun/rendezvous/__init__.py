"""Rendezvous: which nodes form the job in each round, where rank 0 listens, and scale events.

- :mod:`.api`: the :class:`RendezvousHandler` interface the agent drives, :class:`Directive`.
- :mod:`.records`: the store's key layout and typed records (shared with ``hyperpodctl``).
- :mod:`.decider`: the scale-event protocol as a pure function of the records and the time.
- :mod:`.elastic`: store-backed membership (and the decider when this node holds the key).
- :mod:`.static`: torchrun's fixed membership.
- :mod:`.ports`: the ports a node advertises for rank 0's store, held until a round binds them.

:func:`create_rendezvous` builds the right one from a :class:`~hyperpodrun.config.LaunchConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperpodrun.rendezvous.api import (
    Directive,
    DirectiveKind,
    LocalStatus,
    RendezvousHandler,
    RestartReason,
    RoundInfo,
)
from hyperpodrun.rendezvous.ports import PortReservation

if TYPE_CHECKING:
    from hyperpodrun.config import LaunchConfig
    from hyperpodrun.events import EventLog

__all__ = [
    "Directive",
    "DirectiveKind",
    "LocalStatus",
    "RendezvousHandler",
    "RestartReason",
    "RoundInfo",
    "PortReservation",
    "create_rendezvous",
]


def create_rendezvous(config: LaunchConfig, events: EventLog | None = None) -> RendezvousHandler:
    """Static membership for ``--rdzv-backend static`` and ``--standalone``; the store-backed one otherwise."""
    from hyperpodrun.config import RendezvousMode
    from hyperpodrun.errors import ConfigError

    if config.mode is RendezvousMode.STATIC:
        from hyperpodrun.rendezvous.static import StaticRendezvous

        return StaticRendezvous(
            nnodes=config.max_nodes,
            node_rank=config.node_rank,
            nproc_per_node=config.nproc_per_node,
            master_addr=config.master_addr,
            master_port=config.master_port,
            max_restarts=config.max_restarts,
        )
    from hyperpodrun.netif import route_address
    from hyperpodrun.rendezvous.decider import DeciderContext
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous
    from hyperpodrun.store import create_store

    settings = config.rdzv_settings
    store = create_store(
        config.rdzv_backend,
        config.rdzv_endpoint or f"127.0.0.1:{config.backend.default_port}",
        run_id=config.rdzv_id,
        conf=config.store_conf,
        timeout=settings.store_timeout,
    )
    if config.policy is None:
        raise ConfigError("an elastic job needs its policy (--nnodes MIN:MAX or --elastic-policy)")
    context = DeciderContext(
        policy=config.policy,
        nproc_per_node=config.nproc_per_node,
        max_restarts=config.max_restarts,
        lease_ttl=settings.lease_ttl,
        ack_timeout=settings.ack_timeout,
        propagation=settings.propagation,
        tick=settings.tick,
        max_world_size=config.max_world_size,
        restart_mode=config.restart_mode,
        last_call_timeout=settings.last_call_timeout,
    )
    return ElasticRendezvous(
        store,
        context=context,
        local_addr=config.local_addr or route_address(*config.rdzv_host_port),
        join_timeout=settings.join_timeout,
        events=events,
    )
