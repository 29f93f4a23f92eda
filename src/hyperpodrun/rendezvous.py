"""Rendezvous: which nodes form the job in each round, and where rank 0 listens.

``RendezvousHandler`` is the small interface the agent drives. ``StaticRendezvous``
is torchrun's fixed membership (``--nnodes N --node-rank R --master-addr A``, or one
node). The elastic, store-backed implementation lives in
:mod:`hyperpodrun.elastic_rendezvous`.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

from hyperpodrun.supervisor import GroupAssignment


class RestartReason(str, Enum):
    """Why a worker group is (re)started; exported as ``HYPERPODRUN_RESTART_REASON``."""

    START = "start"
    SCALE = "scale"
    FAILURE = "failure"


@dataclass(frozen=True, kw_only=True)
class RoundInfo:
    round: int
    assignment: GroupAssignment
    members: tuple[str, ...]
    reason: RestartReason = RestartReason.START
    restarts: int = 0  # failure restarts used by the job so far (TORCHELASTIC_RESTART_COUNT)


class RendezvousHandler(ABC):
    """One node's view of the job's membership."""

    @property
    @abstractmethod
    def node_id(self) -> str: ...

    @abstractmethod
    def next_round(self, *, timeout: float) -> RoundInfo:
        """Block until this node is a member of a new round; raises RendezvousTimeoutError."""

    def shutdown(self, *, succeeded: bool) -> None:  # noqa: B027 - optional hook
        """Leave the job for good (the agent is exiting)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (torchrun picks MASTER_PORT the same way)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StaticRendezvous(RendezvousHandler):
    """Fixed membership: every node knows its rank, the node count and the master address."""

    def __init__(
        self,
        *,
        nnodes: int,
        node_rank: int,
        nproc_per_node: int,
        master_addr: str,
        master_port: int | None,
    ) -> None:
        self._nnodes = nnodes
        self._node_rank = node_rank
        self._nproc = nproc_per_node
        self._master_addr = master_addr
        # One node and no port given: a free one per round (torchrun: c10d at localhost:0).
        if master_port is None and nnodes > 1:
            master_port = 29500  # torchrun's static default; every node must agree without talking
        self._master_port = master_port
        self._round = 0

    @property
    def node_id(self) -> str:
        return f"{socket.gethostname()}-node{self._node_rank}"

    def next_round(self, *, timeout: float) -> RoundInfo:
        self._round += 1
        return RoundInfo(
            round=self._round,
            assignment=GroupAssignment(
                group_rank=self._node_rank,
                group_world_size=self._nnodes,
                nproc_per_node=self._nproc,
                master_addr=self._master_addr,
                master_port=self._master_port if self._master_port is not None else free_port(self._master_addr),
            ),
            members=tuple(f"node{i}" for i in range(self._nnodes)),
        )
