"""torchrun's fixed membership: every node knows its rank, the node count and the master address."""

from __future__ import annotations

import socket
from collections.abc import Callable

from elastic_events.contract import GroupAssignment
from hyperpodrun.rendezvous.api import (
    Directive,
    DirectiveKind,
    LocalStatus,
    RendezvousHandler,
    RestartReason,
    RoundInfo,
)
from hyperpodrun.rendezvous.ports import PortReservation, reserve_anew
from hyperpodrun.rendezvous.records import EventKind
from hyperpodrun.supervisor import WorkerState

STATIC_MASTER_PORT = 29500  # torchrun's static default; every node must agree without talking


class StaticRendezvous(RendezvousHandler):
    """Rounds of a fixed membership: a new round after each failure while restarts are left."""

    def __init__(
        self,
        *,
        nnodes: int,
        node_rank: int,
        nproc_per_node: int,
        master_addr: str,
        master_port: int | None,
        max_restarts: int = 0,
    ) -> None:
        self._nnodes = nnodes
        self._node_rank = node_rank
        self._nproc = nproc_per_node
        self._master_addr = master_addr
        # One node and no port given: a free one per round (torchrun: c10d at localhost:0).
        if master_port is None and nnodes > 1:
            master_port = STATIC_MASTER_PORT
        self._master_port = master_port
        self._round_port: PortReservation | None = None  # a one-node job's port, held for its current round
        self._max_restarts = max_restarts
        self._round = 0
        self._restarts = 0

    @property
    def node_id(self) -> str:
        return f"{socket.gethostname()}-node{self._node_rank}"

    def next_round(self, *, timeout: float, prewarm: Callable[[], bool] | None = None) -> RoundInfo:
        self._round += 1
        master_port = self._master_port
        if master_port is None:
            self._round_port = reserve_anew(self._round_port, self._master_addr)
            master_port = self._round_port.port
        return RoundInfo(
            round=self._round,
            assignment=GroupAssignment(
                group_rank=self._node_rank,
                group_world_size=self._nnodes,
                nproc_per_node=self._nproc,
                master_addr=self._master_addr,
                master_port=master_port,
            ),
            members=tuple(f"node{i}" for i in range(self._nnodes)),
            reason=RestartReason.FAILURE if self._restarts else RestartReason.START,
            restarts=self._restarts,
        )

    def poll(self, status: LocalStatus) -> Directive | None:
        if status.group_state == WorkerState.SUCCEEDED:
            return Directive(kind=DirectiveKind.EXIT, exit_code=0)
        if status.group_state != WorkerState.FAILED:
            return None
        failure = status.failure or "a rank failed"
        if self._restarts >= self._max_restarts:
            n = self._restarts
            suffix = f" (after {n} restart{'s' * (n != 1)})" if n else ""
            return Directive(
                kind=DirectiveKind.EXIT, exit_code=1, event_kind=EventKind.RANK_FAILURE, reason=failure + suffix
            )
        self._restarts += 1
        return Directive(
            kind=DirectiveKind.STOP,
            event_kind=EventKind.RANK_FAILURE,
            reason=f"{failure}; restarting the workers ({self._restarts}/{self._max_restarts})",
        )

    def shutdown(self, *, succeeded: bool) -> None:
        if self._round_port is not None:
            self._round_port.release()
