"""Construction of a node's agent from a :class:`LaunchConfig` (the factory the CLI calls)."""

from __future__ import annotations

import logging
import os

from hyperpodrun.agent import Agent
from hyperpodrun.config import LaunchConfig, new_run_id
from hyperpodrun.events import EventLog
from hyperpodrun.logs import LogDirectory
from hyperpodrun.rendezvous import RendezvousHandler, StaticRendezvous

log = logging.getLogger(__name__)


def create_rendezvous(config: LaunchConfig, events: EventLog) -> RendezvousHandler:
    """Static membership for one node or fixed ``--node-rank`` jobs; the store-backed one otherwise."""
    if config.is_static or config.standalone or config.policy is None:
        return StaticRendezvous(
            nnodes=config.max_nodes,
            node_rank=config.node_rank,
            nproc_per_node=config.nproc_per_node,
            master_addr=config.master_addr,
            master_port=config.master_port,
        )
    from hyperpodrun.elastic_rendezvous import create_elastic_rendezvous

    return create_elastic_rendezvous(config, policy=config.policy, events=events)


def launch(config: LaunchConfig) -> None:
    """Run this node's agent until the job ends; raises a HyperpodrunError on failure."""
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), format="hyperpodrun: %(message)s")
    run_id = config.rdzv_id if config.rdzv_id != "none" else new_run_id()
    logs = LogDirectory(config.log_dir, run_id)
    # --- metrics (--metrics-port): an event-log sink, the store timed, the ranks' progress fed by the agent.
    metrics = server = trainer_records = None
    events_path = config.event_log or logs.run_dir / "events.jsonl"
    if config.metrics_port:
        from hyperpodrun.metrics import AgentMetrics, TrainerRecords, serve

        metrics = AgentMetrics()
        server = serve(metrics, addr=config.metrics_addr, port=config.metrics_port)
        trainer_records = TrainerRecords(events_path, metrics, job=run_id)  # first_step etc., written by the ranks
    try:
        events = EventLog(events_path, job=run_id, node="", sink=metrics)
        rendezvous = create_rendezvous(config, events)
        events.node = rendezvous.node_id
        if metrics is not None and hasattr(rendezvous, "store"):  # time every store call of the rendezvous
            rendezvous.store = metrics.instrument_store(rendezvous.store)
        agent = Agent(config, rendezvous, run_id=run_id, events=events, logs=logs)
        agent.on_progress = metrics.observe_progress if metrics is not None else None
        agent.run()
    finally:
        if trainer_records is not None:
            trainer_records.close()
        if server is not None:
            server.close()
