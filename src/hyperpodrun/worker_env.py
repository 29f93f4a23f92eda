"""The environment of a node's ranks: torchrun's variables exactly, plus ``HYPERPODRUN_*`` extras."""

from __future__ import annotations

import os
from pathlib import Path

from elastic_events import contract
from elastic_events.contract import ROUND_VARIABLES, GroupAssignment, RestartReason, rank_environment
from hyperpodrun.config import LaunchConfig
from hyperpodrun.rendezvous import RoundInfo
from hyperpodrun.security import scrub_secrets


def worker_env(
    config: LaunchConfig,
    rnd: RoundInfo,
    local_rank: int,
    *,
    run_id: str,
    restart_count: int,
    reason: RestartReason,
    error_file: Path,
    control_file: Path,
    node_id: str,
    event_log: Path | None = None,
) -> dict[str, str]:
    """The per-rank environment: torchrun's variables exactly, plus ``HYPERPODRUN_*`` extras."""
    env = {
        **rank_environment(rnd.assignment, local_rank, round=rnd.round),
        "ROLE_NAME": config.role,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(rnd.assignment.nproc_per_node),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        # 2 (CleanUpOnly): on an NCCL error or timeout torch's watchdog aborts the communicators and the
        # error reaches Python, where the in-process repair takes it up; 1 (TearDown) would kill the
        # process, 3 (torch's default) too, without cleaning up.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        contract.CONTROL_FILE_ENV: str(control_file),
        contract.RESTART_REASON_ENV: reason.value,
        contract.NODE_ID_ENV: node_id,
    }
    if event_log is not None:
        env[contract.EVENT_LOG_ENV] = str(event_log)
    return env


def parked_env(env: dict[str, str]) -> dict[str, str]:
    """A pre-warmed joiner's environment: no round yet (``HYPERPODRUN_PARKED=1``)."""
    return {**{k: v for k, v in env.items() if k not in ROUND_VARIABLES}, contract.PARKED_ENV: "1"}


def parked_round(nproc: int) -> RoundInfo:
    return RoundInfo(
        round=0,
        assignment=GroupAssignment(
            group_rank=0, group_world_size=1, nproc_per_node=nproc, master_addr="", master_port=0
        ),
        members=(),
    )


def base_env(config: LaunchConfig) -> dict[str, str]:
    env = scrub_secrets(os.environ)  # the ranks never talk to the store: no credentials for them
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: avoid oversubscribing the node's cores
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in config.signals_to_handle)
    env[contract.SNAPSHOT_EVERY_ENV] = str(config.snapshot_every)
    return env
