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
import shutil
import signal
import tempfile
import sys
import threading
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from types import FrameType

from hyperpodrun.config import LaunchConfig
from hyperpodrun.elastic_rendezvous import Directive, DirectiveKind, ElasticRendezvous, LocalStatus
from hyperpodrun.errors import RendezvousClosedError, RendezvousError, SignalReceived, WorkerFailedError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.logs import LogDirectory
from hyperpodrun.rendezvous import RendezvousHandler, RestartReason, RoundInfo
from hyperpodrun.reaper import Reaper
from hyperpodrun.store import StoreError
from hyperpodrun.supervisor import WorkerGroup, WorkerState, become_subreaper
from elastic_events.control import ControlWriter, EventKind, RankProgress

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
    event_log: Path | None = None,
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
    if event_log is not None:
        env["HYPERPODRUN_EVENT_LOG"] = str(event_log)
    return env


def base_env(config: LaunchConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: avoid oversubscribing the node's cores
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in config.signals_to_handle)
    return env


class Agent:
    """Supervises the local ranks of one node through rounds of the rendezvous."""

    #: Called with the ranks' steps and seconds per step at each poll (metrics, issue 13); None: nobody listens.
    on_progress: Callable[[tuple[int, ...], tuple[float, ...]], None] | None = None

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
        # Node-local, private to this agent: memory-backed where /dev/shm exists.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self._control_dir = Path(tempfile.mkdtemp(prefix="hyperpodrun-", dir=shm))
        self._control = ControlWriter(self._control_dir / "control.bin", config.nproc_per_node)
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
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self.rdzv.shutdown(succeeded=self.state == AgentState.SUCCEEDED)
            self.events.emit(EventType.AGENT_STOPPED, state=self.state.value)

    # -- main loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        if isinstance(self.rdzv, ElasticRendezvous):
            self._loop_elastic(self.rdzv)
            return
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

    # -- elastic loop --------------------------------------------------------------------

    def _loop_elastic(self, rdzv: ElasticRendezvous) -> None:
        """Rounds of an elastic job: run, follow scale events, restart at the new size."""
        rdzv.join()
        while True:
            self.state = AgentState.RENDEZVOUS
            try:
                rnd = self._guard_store(lambda: rdzv.next_round(timeout=rdzv.settings.join_timeout))
            except RendezvousClosedError as e:
                self._finish_closed(str(e), succeeded=e.status != "failed", left=e.status == "left")
                return
            self.restart_count = rnd.restarts
            self.events.round, self.events.world_size = rnd.round, rnd.assignment.world_size
            self.events.emit(EventType.RENDEZVOUS_DONE, members=list(rnd.members), reason=rnd.reason.value)
            print(
                f"hyperpodrun: round {rnd.round}: {len(rnd.members)} node(s), world size "
                f"{rnd.assignment.world_size}, this node is group rank {rnd.assignment.group_rank} ({rnd.reason.value})",
                file=sys.stderr,
                flush=True,
            )
            group = self._start_group(rnd, rnd.reason)
            self.state = AgentState.RUNNING
            directive = self._monitor_elastic(rdzv, group)
            if directive.kind == DirectiveKind.EXIT:
                self._finish_closed(directive.reason, succeeded=directive.exit_code == 0)
                return

    def _monitor_elastic(self, rdzv: ElasticRendezvous, group: WorkerGroup) -> Directive:
        """Watch the ranks and the store until the round ends for this node."""
        pending: Directive | None = None
        deadline = 0.0
        rates = _StepRates(self.config.nproc_per_node)
        next_poll = 0.0
        while True:
            state = group.poll()
            if state == WorkerState.FAILED and pending is None:
                group.stop(grace=self.config.shutdown_timeout)  # siblings of a failed rank stop now
            if self._signal is not None:
                if self._signal == signal.SIGTERM:
                    self._signal = None
                    self._wake.clear()
                    print("hyperpodrun: SIGTERM: leaving the job at the next agreed step", file=sys.stderr, flush=True)
                    self._guard_store(rdzv.request_leave)
                else:
                    self._on_signal(group, self._signal)
            if rdzv.lease_lost:
                group.stop(grace=self.config.shutdown_timeout)
                raise RendezvousError("this node lost its membership lease (store unreachable for a whole lease ttl)")
            now = time.monotonic()
            if now >= next_poll or state != WorkerState.HEALTHY:
                next_poll = now + rdzv.settings.tick
                steps, step_times = rates.update(self._control.progress())
                if self.on_progress is not None:  # metrics (issue 13)
                    self.on_progress(steps, step_times)
                failure = group.failures()[0].summary() if state == WorkerState.FAILED and group.failures() else None
                status = LocalStatus(group_state=state, steps=steps, step_times=step_times, failure=failure)
                directive = self._guard_store(lambda: rdzv.poll(status), group)
                if directive is not None and directive.kind in (DirectiveKind.EXIT, DirectiveKind.STOP):
                    self.events.emit(EventType.WORKERS_SIGNALLED, event_id=directive.event_id, kind=directive.kind.value, reason=directive.reason)
                    group.stop(grace=self.config.shutdown_timeout)
                    self.events.emit(EventType.WORKERS_STOPPED, event_id=directive.event_id)
                    if directive.kind == DirectiveKind.STOP:
                        self._guard_store(lambda: rdzv.report_stopped(directive.event_id, ok=False))
                    self._control.clear()
                    return directive
                if directive is not None and pending is None:
                    pending = directive
                    deadline = now + rdzv.policy.graceful_shutdown_timeout
                    self._control.publish(
                        event_id=directive.event_id,
                        target_step=directive.target_step,
                        kind=EventKind.SAVE_AND_EXIT,
                        round=self.events.round + 1,
                        world_size=directive.world_size,
                    )
                    self.events.emit(
                        EventType.WORKERS_SIGNALLED, event_id=directive.event_id, target_step=directive.target_step,
                        steps=list(steps), reason=directive.reason,
                    )  # fmt: skip
            if pending is not None and (state != WorkerState.HEALTHY or now > deadline):
                if state == WorkerState.HEALTHY:
                    print(
                        f"hyperpodrun: ranks did not exit within the graceful shutdown timeout "
                        f"({rdzv.policy.graceful_shutdown_timeout:g}s); killing them",
                        file=sys.stderr,
                        flush=True,
                    )
                group.stop(grace=self.config.shutdown_timeout)
                ok = state == WorkerState.SUCCEEDED
                self.events.emit(EventType.WORKERS_STOPPED, event_id=pending.event_id, ok=ok)
                self._control.clear()
                self._guard_store(lambda: rdzv.report_stopped(pending.event_id, ok=ok))
                return pending
            self._wake.wait(self.config.monitor_interval)

    def _guard_store(self, fn, group: WorkerGroup | None = None):
        """Run a store operation; a lost store stops the ranks and ends the agent with its message."""
        try:
            return fn()
        except StoreError as e:
            if group is not None:
                group.stop(grace=self.config.shutdown_timeout)
            self.events.emit(EventType.STORE_LOST, message=str(e))
            raise RendezvousError(f"lost the rendezvous store: {e}") from None

    def _finish_closed(self, message: str, *, succeeded: bool, left: bool = False) -> None:
        if not succeeded:
            self.state = AgentState.FAILED
            raise WorkerFailedError(message)
        self.state = AgentState.SUCCEEDED
        if left:
            print("hyperpodrun: left the job gracefully", file=sys.stderr, flush=True)

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
                event_log=self.events.path,
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


class _StepRates:
    """Seconds per step of each local rank, from successive control-channel readings."""

    def __init__(self, nproc: int) -> None:
        self._last: list[RankProgress | None] = [None] * nproc
        self._rate = [0.0] * nproc

    def update(self, progress: list[RankProgress]) -> tuple[tuple[int, ...], tuple[float, ...]]:
        for r, p in enumerate(progress):
            last = self._last[r]
            if last is not None and p.step > last.step and p.time > last.time:
                self._rate[r] = (p.time - last.time) / (p.step - last.step)
            if last is None or p.step != last.step:
                self._last[r] = p
        return tuple(p.step for p in progress), tuple(self._rate)
