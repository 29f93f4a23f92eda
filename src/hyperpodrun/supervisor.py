"""Worker supervision: spawn the local ranks with torchrun's environment, watch them, stop them.

Each rank runs in its own session (process group). Stopping a rank stops its whole
process tree: SIGTERM to every process of the tree, a grace period, then SIGKILL. A rank
that takes SIGTERM as a request to leave the job (``elastic_events.termination``) and its
tree get SIGKILL at once.
On Linux the launcher makes itself a *child subreaper*, so grandchildren whose
parent died (e.g. dataloader workers of a crashed rank) are re-parented to the
launcher instead of init and are still found and stopped; and each rank gets
``PR_SET_PDEATHSIG=SIGKILL``, so even ``kill -9`` of the launcher leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from string import Template

import psutil

from elastic_events.contract import GroupAssignment
from hyperpodrun.errors import LaunchError
from hyperpodrun.forkserver import ForkedProcess, ForkServer
from hyperpodrun.logs import RankLogs, StreamPump, open_for_child
from hyperpodrun.reaper import Reaper

log = logging.getLogger(__name__)

#: The console prefix of a rank's lines unless ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` sets one.
DEFAULT_PREFIX_TEMPLATE = "[rank${rank}]:"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def become_subreaper() -> bool:
    """Orphaned descendants of our workers are re-parented to us (Linux), so none escape.

    Returns whether the process was a subreaper already, for :func:`restore_subreaper` (a
    program that runs the agent in its own process gets its setting back).
    """
    if _prctl is None:
        return False
    was = ctypes.c_int(0)
    _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    return bool(was.value)


def is_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (see :func:`become_subreaper`)."""
    if _prctl is None:
        return False
    now = ctypes.c_int(0)
    _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(now), 0, 0, 0)
    return bool(now.value)


def restore_subreaper(was: bool) -> None:
    if _prctl is not None and not was:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def child_setup() -> None:  # runs in the child between fork and exec: no Python-level locks
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class WorkerState(str, Enum):
    """State of a worker group. INIT -> HEALTHY -> (SUCCEEDED | FAILED | STOPPED)."""

    INIT = "init"
    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """Why one rank failed; ``summary()`` is the one-line root cause shown to the user."""

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    timestamp: float
    log_file: Path
    error_file: Path
    message: str | None = None  # from the @record error file, if the rank wrote one

    @property
    def signal_name(self) -> str | None:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None

    def summary(self) -> str:
        how = f"was killed by {self.signal_name}" if self.signal_name else f"exited with code {self.exitcode}"
        text = f"rank {self.global_rank} (local rank {self.local_rank}, pid {self.pid}) {how}"
        if self.message:
            text += f": {self.message}"
        return f"{text}; log: {self.log_file}"

    def record(self) -> dict[str, object]:
        """The fields of the ``worker_failed`` event record."""
        return dict(
            rank=self.global_rank,
            exitcode=self.exitcode,
            signal=self.signal_name,
            message=self.message,
            log_file=str(self.log_file),
        )


def read_error_file(path: Path) -> str | None:
    """The exception recorded by ``torch.distributed.elastic.multiprocessing.errors.record``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str):
        return None
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


@dataclass
class _Rank:
    local_rank: int
    global_rank: int
    proc: subprocess.Popen | ForkedProcess
    logs: RankLogs
    pumps: list[StreamPump] = field(default_factory=list)
    exit_time: float | None = None


class WorkerGroup:
    """The local ranks of one attempt. Not thread-safe: driven by the agent's loop."""

    def __init__(
        self,
        *,
        command: list[str],
        base_env: dict[str, str],
        rank_env: dict[int, dict[str, str]],
        assignment: GroupAssignment,
        logs: dict[int, RankLogs],
        reaper: Reaper | None = None,
        prefix_template: str = DEFAULT_PREFIX_TEMPLATE,
        role: str = "default",
        sigterm_leaves: Callable[[], Collection[int]] | None = None,
        forkserver: ForkServer | None = None,
    ) -> None:
        self._reaper = reaper
        self._forkserver = forkserver
        self._prefix_template = prefix_template
        self._role = role
        # The local ranks for which SIGTERM is a request to leave the job, not an end: stop() SIGKILLs them.
        self._sigterm_leaves = sigterm_leaves
        self._command = command
        self._base_env = base_env
        self._rank_env = rank_env
        self.assignment = assignment
        self._logs = logs
        self._ranks: list[_Rank] = []
        self._spare: _Rank | None = None  # a pre-started replacement (elastic_events.rounds.spare)
        self.state = WorkerState.INIT
        # Local ranks whose training finished (their control slot says FINISHED): a non-zero exit after it is
        # a crash at interpreter exit, not a failure of the job (counted as success, said once: newly_forgiven()).
        self.finished: set[int] = set()
        self._forgiven: set[int] = set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, parked: bool = False) -> None:
        """Start the local ranks; ``parked`` ranks (a standby's) do not wait for the fork server's imports: the
        launcher's loop goes on at once (they start as fresh processes while the server is not ready)."""
        for local_rank in range(self.assignment.nproc_per_node):
            self._ranks.append(self._spawn(local_rank, wait_for_server=not parked))
        self.state = WorkerState.HEALTHY

    def _spawn(self, local_rank: int, *, wait_for_server: bool = True) -> _Rank:
        return self._start_process(
            self._command,
            {**self._base_env, **self._rank_env[local_rank]},
            self._logs[local_rank],
            local_rank=local_rank,
            global_rank=self.assignment.global_rank(local_rank),
            wait_for_server=wait_for_server,
        )

    def start_spare(self, command: list[str], *, env: dict[str, str], logs: RankLogs) -> int:
        """Start a spare (see :mod:`elastic_events.rounds.spare`) beside the ranks; its pid. It is stopped with them."""
        if self._spare is not None and self._spare.proc.poll() is None:
            raise ValueError(f"a spare (pid {self._spare.proc.pid}) is already running")
        self._spare = self._start_process(
            command, {**self._base_env, **env}, logs, local_rank=-1, global_rank=-1, wait_for_server=False
        )
        return self._spare.proc.pid

    @property
    def spare_running(self) -> bool:
        """A spare process is alive: parked, or still importing what it pays in advance."""
        return self._spare is not None and self._spare.proc.poll() is None

    @property
    def spare_pid(self) -> int | None:
        return self._spare.proc.pid if self._spare is not None else None

    @property
    def spare_log(self) -> Path | None:
        return self._spare.logs.stderr_file if self._spare is not None else None

    def drop_spare(self) -> None:
        """Kill the spare, if any (it holds no state)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        _killpg(spare.proc.pid, signal.SIGKILL)
        try:
            spare.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.warning("spare (pid %d) did not exit after SIGKILL", spare.proc.pid)
        if self._reaper is not None:
            self._reaper.remove(spare.proc.pid)
        for pump in spare.pumps:
            pump.join(5.0)

    def promote_spare(self, local_rank: int) -> int:
        """The spare takes the place of ``local_rank`` (which exited; its slot told to the spare); its pid."""
        spare, old = self._spare, self._ranks[local_rank]
        if spare is None or spare.proc.poll() is not None:
            raise ValueError("no running spare to promote")
        self._retire(old)
        spare.local_rank, spare.global_rank = local_rank, old.global_rank
        for pump in spare.pumps:
            pump.relabel(self._prefix(local_rank, old.global_rank))
        self._ranks[local_rank], self._spare = spare, None
        self._refresh_after_replace()
        return spare.proc.pid

    def _start_process(
        self,
        command: list[str],
        env: dict[str, str],
        logs: RankLogs,
        *,
        local_rank: int,
        global_rank: int,
        wait_for_server: bool = True,
    ) -> _Rank:
        out_fd = None if logs.console_stdout else open_for_child(logs.stdout_file)
        err_fd = None if logs.console_stderr else open_for_child(logs.stderr_file)
        proc: subprocess.Popen | ForkedProcess | None = None
        try:
            if self._forkserver is not None:
                proc = _fork(self._forkserver, command, env, out_fd, err_fd, wait_ready=wait_for_server)
            if proc is None:
                proc = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out_fd if out_fd is not None else subprocess.PIPE,
                    stderr=err_fd if err_fd is not None else subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=child_setup,
                )
        except OSError as e:
            raise LaunchError(f"cannot start worker {command[0]!r}: {e.strerror}") from None
        finally:
            for fd in (out_fd, err_fd):
                if fd is not None:
                    os.close(fd)
        if self._reaper is not None:
            self._reaper.add(proc.pid)  # the rank's process group: pgid == pid (own session)
        rank = _Rank(local_rank, global_rank, proc, logs)
        prefix = self._prefix(local_rank, global_rank) if global_rank >= 0 else "[spare]:"
        if proc.stdout is not None:
            rank.pumps.append(StreamPump(proc.stdout, prefix=prefix, file=logs.stdout_file, console=sys.stdout))
        if proc.stderr is not None:
            rank.pumps.append(StreamPump(proc.stderr, prefix=prefix, file=logs.stderr_file, console=sys.stderr))
        for pump in rank.pumps:
            pump.start()
        return rank

    def _prefix(self, local_rank: int, global_rank: int) -> str:
        """A rank's console prefix: torchrun's template macros ``${role_name}``, ``${rank}``, ``${local_rank}``."""
        return Template(self._prefix_template).safe_substitute(
            role_name=self._role, rank=global_rank, local_rank=local_rank
        )

    def replace(self, local_rank: int, *, rank_env: dict[str, str], logs: RankLogs) -> int:
        """Start a new process in place of a local rank that exited (its siblings keep running); its pid.

        The group is HEALTHY again once no replaced rank is left failed.
        """
        self._retire(self._ranks[local_rank])
        self._rank_env[local_rank], self._logs[local_rank] = rank_env, logs
        self._ranks[local_rank] = self._spawn(local_rank)
        self._refresh_after_replace()
        return self._ranks[local_rank].proc.pid

    def _retire(self, old: _Rank) -> None:
        """Clean up after a rank that exited and is being replaced."""
        if old.proc.poll() is None:
            raise ValueError(
                f"local rank {old.local_rank} (pid {old.proc.pid}) is still running: only an exited rank is replaced"
            )
        _killpg(old.proc.pid, signal.SIGKILL)  # its dataloader workers
        for pump in old.pumps:
            pump.join(5.0)
        if self._reaper is not None:
            self._reaper.remove(old.proc.pid)

    def _refresh_after_replace(self) -> None:
        if self.state == WorkerState.FAILED and all(r.proc.returncode in (None, 0) for r in self._ranks):
            self.state = WorkerState.HEALTHY

    @property
    def pids(self) -> dict[int, int]:
        return {r.local_rank: r.proc.pid for r in self._ranks}

    def log_file(self, local_rank: int) -> Path:
        """Where a local rank's stderr goes (stack dumps land there)."""
        return self._logs[local_rank].stderr_file

    def poll(self) -> WorkerState:
        """Update and return the group state; FAILED as soon as any rank failed."""
        if self.state not in (WorkerState.HEALTHY,):
            return self.state
        now = time.time()
        running = False
        for r in self._ranks:
            code = r.proc.poll()
            if code is None:
                running = True
            elif r.exit_time is None:
                r.exit_time = now
        if any(r.proc.returncode not in (None, 0) and r.local_rank not in self.finished for r in self._ranks):
            self.state = WorkerState.FAILED
        elif not running:
            self._join_pumps(timeout=5.0)
            self.state = WorkerState.SUCCEEDED
        return self.state

    def failures(self) -> list[WorkerFailure]:
        """Failed ranks, earliest first (the first one is the root cause); a finished rank's exit is no failure."""
        return [f for f in self._exits() if f.local_rank not in self.finished]

    def newly_forgiven(self) -> list[WorkerFailure]:
        """Finished ranks that exited non-zero since the last call: their training had ended, the job's outcome
        does not change."""
        new = [f for f in self._exits() if f.local_rank in self.finished and f.local_rank not in self._forgiven]
        self._forgiven.update(f.local_rank for f in new)
        return new

    def _exits(self) -> list[WorkerFailure]:
        out = []
        for r in self._ranks:
            code = r.proc.returncode
            if code is None or code == 0:
                continue
            out.append(
                WorkerFailure(
                    local_rank=r.local_rank,
                    global_rank=r.global_rank,
                    pid=r.proc.pid,
                    exitcode=code,
                    timestamp=r.exit_time or time.time(),
                    log_file=r.logs.stderr_file,
                    error_file=r.logs.error_file,
                    message=read_error_file(r.logs.error_file),
                )
            )
        # A rank that recorded an exception is a better root cause than one killed as collateral.
        out.sort(key=lambda f: (f.timestamp, f.message is None, f.global_rank))
        return out

    def signal_all(self, sig: int) -> None:
        """Deliver ``sig`` to every live rank's process group (forwarding a signal)."""
        for r in self._ranks:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, *, grace: float, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and all its descendants: ``sig``, up to ``grace`` seconds, then SIGKILL."""
        self.drop_spare()
        if sig == signal.SIGTERM and self._sigterm_leaves is not None:
            for local_rank in self._sigterm_leaves():
                self._kill_tree(local_rank)
        procs = self._tree()
        for p in procs:
            _send(p, sig)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for p in alive:
            _send(p, signal.SIGKILL)
        for r in self._ranks:
            _killpg(r.proc.pid, signal.SIGKILL)  # members of the group that left the tree
        psutil.wait_procs(alive, timeout=5.0)
        for r in self._ranks:
            try:
                r.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.warning("rank %d (pid %d) did not exit after SIGKILL", r.global_rank, r.proc.pid)
            if r.exit_time is None:
                r.exit_time = time.time()
        self._reap_orphans()
        if self._reaper is not None:
            for r in self._ranks:
                self._reaper.remove(r.proc.pid)
        self._join_pumps(timeout=5.0)
        if self.state == WorkerState.HEALTHY:
            self.state = WorkerState.STOPPED

    def _kill_tree(self, local_rank: int) -> None:
        """SIGKILL a local rank and every process below it (its data-loader workers: they block SIGTERM too)."""
        if not 0 <= local_rank < len(self._ranks) or self._ranks[local_rank].proc.poll() is not None:
            return
        root = self._ranks[local_rank].proc.pid
        try:
            below = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            below = []
        _killpg(root, signal.SIGKILL)
        for p in below:
            _send(p, signal.SIGKILL)

    def _tree(self) -> list[psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        for r in self._ranks:
            try:
                root = psutil.Process(r.proc.pid)
                procs[root.pid] = root
                for child in root.children(recursive=True):
                    procs[child.pid] = child
            except psutil.NoSuchProcess:
                pass
        # Orphans re-parented to us (we are a subreaper) whose rank already exited.
        try:
            rank_pids = {r.proc.pid for r in self._ranks}
            for child in psutil.Process().children(recursive=True):
                try:
                    if child.pid not in rank_pids and os.getpgid(child.pid) in rank_pids:
                        procs[child.pid] = child
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass
        except psutil.NoSuchProcess:
            pass
        return list(procs.values())

    def _reap_orphans(self) -> None:
        """Collect the exit statuses of our ranks' descendants that were re-parented to us (a subreaper),
        so none lingers as a zombie; never another child of the process (an embedding program's own)."""
        rank_pgids = {r.proc.pid for r in self._ranks}
        try:
            children = psutil.Process().children()
        except psutil.NoSuchProcess:
            return
        for child in children:
            if child.pid in rank_pgids:
                continue  # a rank: its Popen collects it
            try:
                if os.getpgid(child.pid) not in rank_pgids:
                    continue
                os.waitpid(child.pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError):
                continue

    def _join_pumps(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r in self._ranks:
            for pump in r.pumps:
                pump.join(max(0.0, deadline - time.monotonic()))


def _fork(
    server: ForkServer,
    command: list[str],
    env: dict[str, str],
    out_fd: int | None,
    err_fd: int | None,
    *,
    wait_ready: bool,
) -> ForkedProcess | None:
    """A rank forked by the node's fork server (a pipe for a stream shown on the console); None if it cannot."""
    pipes = {name: os.pipe() for name, fd in (("stdout", out_fd), ("stderr", err_fd)) if fd is None}
    try:
        proc = server.spawn(
            command,
            env=env,
            stdout=out_fd if out_fd is not None else pipes["stdout"][1],
            stderr=err_fd if err_fd is not None else pipes["stderr"][1],
            wait_ready=wait_ready,
        )
    finally:
        for _, write_end in pipes.values():
            os.close(write_end)
    if proc is None:
        for read_end, _ in pipes.values():
            os.close(read_end)
        return None
    for name, (read_end, _) in pipes.items():
        setattr(proc, name, open(read_end, "rb"))
    return proc


def _send(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
