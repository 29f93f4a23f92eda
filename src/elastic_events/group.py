"""Process groups of in-process rounds: one fresh group per round, nothing of the old one kept.

At a ``RECONFIGURE`` event the ranks destroy their process group and build the new
round's group from the event alone (master address and port, rank, world size): new
rank 0 hosts a ``TCPStore`` on the event's port, bound to the master address only,
and every key goes under a prefix named after the round, so a late message of the
old group can never be read by the new one. The torchrun variables of the process
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) are updated to the new round so that
code reading them (``eventlog``, user code) sees the new world.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_events.control import Event
from elastic_events.errors import ElasticTrainingError, GroupError, PeerFailureError
from elastic_events.names import ROUND_ENV


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """Everything a rank needs to join one round's process group."""

    round: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise GroupError(f"rank {self.rank} is outside world size {self.world_size} of round {self.round}")
        if not self.master_addr or not 0 < self.master_port < 65536:
            raise GroupError(f"round {self.round} has no master address ({self.master_addr!r}:{self.master_port})")

    @classmethod
    def from_event(cls, event: Event, *, local_rank: int, local_world_size: int) -> RoundSpec:
        """This rank's place in the event's round (the node must not be leaving)."""
        if event.leaves:
            raise GroupError(f"event {event.event_id} does not place this node in round {event.round}")
        return cls(
            round=event.round,
            rank=event.group_rank * local_world_size + local_rank,
            world_size=event.world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            group_rank=event.group_rank,
            group_world_size=event.group_world_size,
            master_addr=event.master_addr,
            master_port=event.master_port,
        )

    def environment(self) -> dict[str, str]:
        """The torchrun variables of a rank of this round."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            ROUND_ENV: str(self.round),
        }


def default_device(local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _listen_socket(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr:port`` only, never on all interfaces: the round's store carries its
    process group, whose object collectives are pickles (whoever reaches it can run code in the ranks)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise GroupError(f"cannot resolve the master address {addr!r}: {exc}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise GroupError(f"rank 0 cannot listen on {addr}:{port} for the new round's store: {exc}") from None
    return sock


#: How often a rank that arrived before new rank 0 tries to reach the round's store.
LISTENER_POLL_S = 0.01


def wait_for_listener(addr: str, port: int, *, timeout_s: float) -> None:
    """Return once something accepts connections on ``addr:port``.

    c10d's store client retries a refused connection with a doubling backoff, so a rank that
    arrives seconds before rank 0 hosts the store (a parked joiner, admitted while the survivors
    train on to the agreed step) connected about as many seconds late again: 1.3 - 1.4 s of a
    join's group init in the scale_events benchmark. A plain connect every 10 ms costs nothing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise GroupError(
                    f"nothing listens on {addr}:{port} for the new round's store after {timeout_s:.0f}s: {exc}"
                ) from None
            time.sleep(LISTENER_POLL_S)


def init_round_group(spec: RoundSpec, *, device: torch.device, backend: str, timeout_s: float) -> dist.Store:
    """Join ``spec``'s process group (the default group); returns the store, to keep alive with it.

    The caller sets the round's torchrun variables (:meth:`RoundSpec.environment`).
    """
    if dist.is_initialized():
        raise GroupError("a process group is still up: tear it down before joining a new round")
    timeout = timedelta(seconds=timeout_s)
    try:
        if spec.rank == 0:
            sock = _listen_socket(spec.master_addr, spec.master_port)
            store = dist.TCPStore(
                spec.master_addr,
                spec.master_port,
                spec.world_size,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
        else:
            wait_for_listener(spec.master_addr, spec.master_port, timeout_s=timeout_s)
            store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
        prefixed = dist.PrefixStore(f"hyperpodrun/round-{spec.round}/", store)
        dist.init_process_group(
            backend,
            store=prefixed,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, OSError) as exc:  # c10d reports store timeouts as RuntimeError subclasses
        raise GroupError(
            f"rank {spec.rank}: forming round {spec.round}'s group of {spec.world_size} ranks at "
            f"{spec.master_addr}:{spec.master_port} failed or timed out (limit {timeout_s:.0f}s): {exc}"
        ) from exc
    return store


def init_env_group(*, device: torch.device, backend: str, timeout_s: float) -> bool:
    """Join the group torchrun / hyperpodrun describe in the environment; False without one."""
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    dist.init_process_group(
        backend, timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None
    )
    return True


def teardown_group(*, broken: bool = False) -> None:
    """Destroy the default group and every subgroup (no-op without one).

    ``broken``: a peer died. NCCL communicators are aborted first (destroying one that waits
    on a dead peer blocks); gloo's fail at once when a peer's connection closes.
    """
    if not dist.is_initialized():
        return
    if broken and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()


#: What gloo and NCCL put in the error of a collective whose peer died or stopped answering.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "read error",
    "write error",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "gloo",
    "socket",
    "remote worker",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank died or hung (not a bug of this rank).

    torch raises ``DistError`` subclasses from c10d, but a failure inside DDP's backward
    reaches the script as a plain ``RuntimeError`` carrying gloo's or NCCL's message.
    """
    if isinstance(exc, ElasticTrainingError):  # ours: the in-process API already reported it
        return False
    if isinstance(exc, (dist.DistError, PeerFailureError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _PEER_FAILURE_MARKERS)
