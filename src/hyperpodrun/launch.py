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
    succeeded = False
    try:
        events = EventLog(config.event_log or logs.run_dir / "events.jsonl", job=run_id, node="")
        rendezvous = create_rendezvous(config, events)
        events.node = rendezvous.node_id
        agent = Agent(config, rendezvous, run_id=run_id, events=events, logs=logs, rdzv_timeout=config.rdzv_settings.join_timeout)
        agent.run()
        succeeded = True
    finally:
        logs.finish(succeeded=succeeded)  # a failed job's worker logs stay for the user to read
