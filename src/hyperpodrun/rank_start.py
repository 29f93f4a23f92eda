"""Starting a node's ranks: attempt folders, each rank's logs and environment, the worker group.

:class:`RankStarter` is what the agent (and its in-place repair) uses to start ranks: a new attempt
folder per start (never deleted), each local rank's log files and torchrun's environment for its
round (:mod:`.worker_env`; a parked rank gets no round until it is admitted), and the
:class:`~hyperpodrun.supervisor.WorkerGroup` that runs them.
"""

from __future__ import annotations

from pathlib import Path

from elastic_events.contract import RestartReason
from elastic_events.control import ControlWriter
from hyperpodrun.config import LaunchConfig
from hyperpodrun.forkserver import ForkServer
from hyperpodrun.logs import LogDirectory, RankLogs
from hyperpodrun.reaper import Reaper
from hyperpodrun.rendezvous import RoundInfo
from hyperpodrun.sigterm import ranks_leaving_on_sigterm
from hyperpodrun.supervisor import DEFAULT_PREFIX_TEMPLATE, WorkerGroup, child_setup, is_subreaper
from hyperpodrun.worker_env import base_env, parked_env, parked_round, worker_env

__all__ = ["RankStarter"]


class RankStarter:
    """Starts one node's ranks for a round (or parked), each start in an attempt folder of its own."""

    def __init__(
        self,
        config: LaunchConfig,
        *,
        run_id: str,
        logs: LogDirectory,
        control: ControlWriter,
        node_id: str,
        event_log: Path | None,
    ) -> None:
        self.config, self.run_id, self._logs, self._control = config, run_id, logs, control
        self._node_id, self._event_log = node_id, event_log
        self._attempt = 0
        self.net_env: dict[str, str] = {}  # GLOO_SOCKET_IFNAME chosen once at join (netif.py)
        self.restart_count = 0  # failure restarts the job used so far (the round's; TORCHELASTIC_RESTART_COUNT)
        self.reaper: Reaper | None = None
        self.forkserver: ForkServer | None = None

    def start_forkserver(self) -> None:
        """With ``--start-method forkserver``, start the node's fork server (:mod:`hyperpodrun.forkserver`) now:
        it imports torch while the launcher joins the rendezvous. Needs the launcher to be a child subreaper."""
        cfg = self.config
        if cfg.start_method == "forkserver" and not cfg.no_python and self.forkserver is None and is_subreaper():
            self.forkserver = ForkServer(python=cfg.python, env=base_env(cfg), preexec_fn=child_setup)

    def stop_forkserver(self) -> None:
        server, self.forkserver = self.forkserver, None
        if server is not None:
            server.close()

    def new_attempt(self) -> Path:
        """A new attempt folder of the run's logs."""
        path = self._logs.new_attempt(self._attempt)
        self._attempt += 1
        return path

    def rank_setup(
        self, attempt_dir: Path, local_rank: int, rnd: RoundInfo | None, reason: RestartReason
    ) -> tuple[RankLogs, dict[str, str]]:
        """A local rank's log files and environment for ``rnd`` (None: parked until admitted)."""
        cfg = self.config
        logs = LogDirectory.rank_logs(
            attempt_dir,
            local_rank,
            redirect=cfg.redirect_map[local_rank],
            tee=cfg.tee_map[local_rank],
            show_on_console=not cfg.local_ranks_filter or local_rank in cfg.local_ranks_filter,
        )
        env = worker_env(
            cfg,
            rnd or parked_round(cfg.nproc_per_node),
            local_rank,
            run_id=self.run_id,
            restart_count=self.restart_count,
            reason=reason,
            error_file=logs.error_file,
            control_file=self._control.path,
            node_id=self._node_id,
            event_log=self._event_log,
        )
        return logs, env if rnd is not None else parked_env(env)

    def start(self, rnd: RoundInfo | None, reason: RestartReason) -> tuple[WorkerGroup, Path]:
        """Start the local ranks for ``rnd`` (None: parked: no rank, world or master until admitted);
        the group and its attempt folder."""
        attempt_dir = self.new_attempt()
        cfg = self.config
        logs, envs = {}, {}
        for local_rank in range(cfg.nproc_per_node):
            logs[local_rank], envs[local_rank] = self.rank_setup(attempt_dir, local_rank, rnd, reason)
        self._control.reset_ranks()
        group = WorkerGroup(
            command=cfg.worker_command(),
            base_env={**base_env(cfg), **self.net_env},
            rank_env=envs,
            assignment=(rnd or parked_round(cfg.nproc_per_node)).assignment,
            logs=logs,
            reaper=self.reaper,
            prefix_template=cfg.log_line_prefix_template or DEFAULT_PREFIX_TEMPLATE,
            role=cfg.role,
            sigterm_leaves=lambda: ranks_leaving_on_sigterm(self._control.progress()),
            forkserver=self.forkserver,
        )
        group.start(parked=rnd is None)
        return group, attempt_dir
