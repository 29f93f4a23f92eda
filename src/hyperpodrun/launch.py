"""Construction of a node's agent from a :class:`LaunchConfig` (the factory the CLI calls)."""

from __future__ import annotations

import logging
import os

from hyperpodrun.agent import Agent
from hyperpodrun.config import LaunchConfig, new_run_id
from hyperpodrun.events import EventLog
from hyperpodrun.logs import LogDirectory
from hyperpodrun.rendezvous import create_rendezvous

log = logging.getLogger(__name__)


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
    succeeded = False
    try:
        events = EventLog(events_path, job=run_id, node="", sink=metrics)
        rendezvous = create_rendezvous(config, events)
        events.node = rendezvous.node_id
        if metrics is not None and hasattr(rendezvous, "store"):  # time every store call of the rendezvous
            rendezvous.store = metrics.instrument_store(rendezvous.store)
        agent = Agent(
            config, rendezvous, run_id=run_id, events=events, logs=logs, rdzv_timeout=config.rdzv_settings.join_timeout
        )
        agent.on_progress = metrics.observe_progress if metrics is not None else None
        agent.run()
        succeeded = True
    finally:
        logs.finish(succeeded=succeeded)  # a failed job's worker logs stay for the user to read
        if trainer_records is not None:
            trainer_records.close()
        if server is not None:
            server.close()
