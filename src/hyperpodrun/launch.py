"""Construction of a node's agent from a :class:`LaunchConfig` (the factory the CLI calls)."""

from __future__ import annotations

import logging
import os

from elastic_events.contract import RestartReason
from elastic_events.control import ControlWriter
from hyperpodrun.agent import Agent
from hyperpodrun.agent_dir import AgentDir
from hyperpodrun.config import LaunchConfig, new_run_id
from hyperpodrun.events import EventLog
from hyperpodrun.logs import LogDirectory
from hyperpodrun.rank_start import RankStarter
from hyperpodrun.rendezvous import RendezvousHandler, create_rendezvous
from hyperpodrun.repair import InPlaceRepair, spares_for

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
        agent = create_agent(config, rendezvous, run_id=run_id, events=events, logs=logs)
        agent.on_progress = metrics.observe_progress if metrics is not None else None
        agent.run()
        succeeded = True
    finally:
        logs.finish(succeeded=succeeded)  # a failed job's worker logs stay for the user to read
        if trainer_records is not None:
            trainer_records.close()
        if server is not None:
            server.close()


def create_agent(
    config: LaunchConfig, rendezvous: RendezvousHandler, *, run_id: str, events: EventLog, logs: LogDirectory
) -> Agent:
    """The agent of one node with its real parts: a node-local folder private to it (memory-backed where
    /dev/shm exists; stale ones of dead agents are swept first), the control channel in it, the rank
    starter and the in-place repair."""
    workdir, swept = AgentDir.create(job=run_id if config.rdzv_id != "none" else None)
    control = ControlWriter(workdir.path / "control.bin", config.nproc_per_node, spares=spares_for(config))
    ranks = RankStarter(
        config, run_id=run_id, logs=logs, control=control, node_id=rendezvous.node_id, event_log=events.path
    )
    repair = InPlaceRepair(
        config,
        control=control,
        events=events,
        new_attempt=ranks.new_attempt,
        rank_setup=lambda directory, local_rank: ranks.rank_setup(directory, local_rank, None, RestartReason.FAILURE),
    )
    return Agent(
        config,
        rendezvous,
        run_id=run_id,
        events=events,
        logs=logs,
        rdzv_timeout=config.rdzv_settings.join_timeout,
        control=control,
        ranks=ranks,
        repair=repair,
        workdir=workdir,
        same_job=swept.same_job,
    )
