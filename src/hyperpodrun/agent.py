"""The per-node agent: rendezvous, start the local ranks, watch them, restart or finish.

States (``AgentState``) and transitions::

    INIT -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                 ^           |--(rank failed, restarts left)--> RENDEZVOUS
                 |           |--(rank failed, none left)------> FAILED
                 |           |--(signal)----------------------> STOPPED
                 '-----------'--(membership change: scale)----> RENDEZVOUS   (elastic only)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from types import FrameType

from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import SignalReceived, WorkerFailedError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.logs import LogDirectory
from hyperpodrun.rendezvous import RendezvousHandler, RestartReason, RoundInfo
from hyperpodrun.reaper import Reaper
from hyperpodrun.supervisor import WorkerGroup, WorkerState, become_subreaper
from elastic_events.control import ControlWriter

log = logging.getLogger(__name__)

RDZV_TIMEOUT_DEFAULT = 900.0


class AgentState(str, Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


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
) -> dict[str, str]:
    """The per-rank environment: torchrun's variables exactly, plus ``HYPERPODRUN_*`` extras."""
    a = rnd.assignment
    rank = a.global_rank(local_rank)
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": config.role,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(a.nproc_per_node),
        "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.world_size),
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "HYPERPODRUN_CONTROL_FILE": str(control_file),
        "HYPERPODRUN_RESTART_REASON": reason.value,
        "HYPERPODRUN_ROUND": str(rnd.round),
        "HYPERPODRUN_NODE_ID": node_id,
    }
    return env


def base_env(config: LaunchConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: avoid oversubscribing the node's cores
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in config.signals_to_handle)
    return env


class Agent:
    """Supervises the local ranks of one node through rounds of the rendezvous."""

    def __init__(
        self,
        config: LaunchConfig,
        rendezvous: RendezvousHandler,
        *,
        run_id: str,
        events: EventLog,
        logs: LogDirectory,
        rdzv_timeout: float = RDZV_TIMEOUT_DEFAULT,
    ) -> None:
        self.config = config
        self.rdzv = rendezvous
        self.run_id = run_id
        self.events = events
        self.rdzv_timeout = rdzv_timeout
        self.state = AgentState.INIT
        self.restart_count = 0
        self._attempt = 0
        self._logs = logs
        self._control = ControlWriter(self._logs.run_dir / f"control-{os.getpid()}.bin", config.nproc_per_node)
        self._group: WorkerGroup | None = None
        self._reaper: Reaper | None = None
        self._signal: int | None = None
        self._wake = threading.Event()

    # -- public ------------------------------------------------------------------------

    def run(self) -> None:
        """Run the job to completion; raises WorkerFailedError or SignalReceived otherwise."""
        become_subreaper()
        self._reaper = Reaper()
        previous = self._install_signal_handlers()
        self.events.emit(EventType.AGENT_STARTED, pid=os.getpid(), log_dir=str(self._logs.run_dir))
        try:
            self._loop()
        finally:
            if self._group is not None and self._group.state == WorkerState.HEALTHY:
                self._group.stop(grace=self.config.shutdown_timeout)
            self._restore_signal_handlers(previous)
            if self._reaper is not None:
                self._reaper.close()
            self._control.close()
            self.rdzv.shutdown(succeeded=self.state == AgentState.SUCCEEDED)
            self.events.emit(EventType.AGENT_STOPPED, state=self.state.value)

    # -- main loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        reason = RestartReason.START
        while True:
            self.state = AgentState.RENDEZVOUS
            rnd = self.rdzv.next_round(timeout=self.rdzv_timeout)
            self.events.round, self.events.world_size = rnd.round, rnd.assignment.world_size
            self.events.emit(EventType.RENDEZVOUS_DONE, members=list(rnd.members))
            group = self._start_group(rnd, reason)
            self.state = AgentState.RUNNING
            outcome = self._monitor(group)
            if outcome == WorkerState.SUCCEEDED:
                self.state = AgentState.SUCCEEDED
                self.events.emit(EventType.JOB_SUCCEEDED)
                return
            # A rank failed: stop its siblings, then restart or give up.
            failures = group.failures()
            group.stop(grace=self.config.shutdown_timeout)
            failures = failures or group.failures()
            root = failures[0]
            self.events.emit(
                EventType.WORKER_FAILED,
                rank=root.global_rank,
                exitcode=root.exitcode,
                signal=root.signal_name,
                message=root.message,
                log_file=str(root.log_file),
            )
            if self.restart_count >= self.config.max_restarts:
                self.state = AgentState.FAILED
                self.events.emit(EventType.JOB_FAILED, reason=root.summary())
                suffix = f" (after {self.restart_count} restart{'s' * (self.restart_count != 1)})"
                raise WorkerFailedError(root.summary() + (suffix if self.restart_count else ""))
            self.restart_count += 1
            reason = RestartReason.FAILURE
            print(
                f"hyperpodrun: {root.summary()}; restarting the workers "
                f"({self.restart_count}/{self.config.max_restarts})",
                file=sys.stderr,
                flush=True,
            )

    def _start_group(self, rnd: RoundInfo, reason: RestartReason) -> WorkerGroup:
        attempt_dir = self._logs.new_attempt(self._attempt)
        self._attempt += 1
        cfg = self.config
        logs, envs = {}, {}
        for local_rank in range(cfg.nproc_per_node):
            logs[local_rank] = LogDirectory.rank_logs(
                attempt_dir,
                local_rank,
                redirect=cfg.redirect_map[local_rank],
                tee=cfg.tee_map[local_rank],
                show_on_console=not cfg.local_ranks_filter or local_rank in cfg.local_ranks_filter,
            )
            envs[local_rank] = worker_env(
                cfg,
                rnd,
                local_rank,
                run_id=self.run_id,
                restart_count=self.restart_count,
                reason=reason,
                error_file=logs[local_rank].error_file,
                control_file=self._control.path,
                node_id=self.rdzv.node_id,
            )
        self._control.reset_ranks()
        group = WorkerGroup(
            command=cfg.worker_command(),
            base_env=base_env(cfg),
            rank_env=envs,
            assignment=rnd.assignment,
            logs=logs,
            reaper=self._reaper,
        )
        group.start()
        self._group = group
        self.events.emit(
            EventType.WORKERS_STARTED,
            reason=reason.value,
            restart_count=self.restart_count,
            pids=group.pids,
            log_dir=str(attempt_dir),
        )
        return group

    def _monitor(self, group: WorkerGroup) -> WorkerState:
        """Wait until the group finishes or fails, or a signal arrives."""
        while True:
            state = group.poll()
            if state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
                return state
            if self._signal is not None:
                self._on_signal(group, self._signal)
            self._wake.wait(self.config.monitor_interval)

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, group: WorkerGroup, signum: int) -> None:
        self.state = AgentState.STOPPED
        print(
            f"hyperpodrun: received {signal.Signals(signum).name}, stopping workers "
            f"(grace {self.config.shutdown_timeout:g}s)",
            file=sys.stderr,
            flush=True,
        )
        group.stop(grace=self.config.shutdown_timeout, sig=signum)
        raise SignalReceived(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        self._wake.set()

    def _install_signal_handlers(self) -> dict[int, object]:
        previous = {}
        if threading.current_thread() is not threading.main_thread():
            return previous
        for sig in self.config.signals_to_handle:
            try:
                previous[sig] = signal.signal(sig, self._handle)
            except (OSError, ValueError):
                log.warning("cannot handle %s on this platform", sig.name)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
