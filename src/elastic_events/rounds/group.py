"""Process groups of in-process rounds: one fresh group per round, nothing of the old one kept.

At a ``RECONFIGURE`` event the ranks tear their process group down and build the new round's
group from the event alone (master address and port, rank, world size): new rank 0 hosts a
``TCPStore`` on the event's port, bound to the master address only, and every key goes under a
prefix named after the round, so a late message of the old group can never be read by the new
one. The process's environment is never changed: its current round lives in its round engine.

Tearing a group down costs time per NCCL communicator (measured on an H100, torch 2.11, NCCL
2.28: 0.50 s to shut one down, 1.00 s to abort one, whatever NCCL's RAS, torch's heartbeat
monitor or non-blocking communicators; ``benchmarks/results/gpu/2026-11-26-h100``), and
``destroy_process_group()`` / ``_abort_process_group()`` take the communicators one after
another (4 of them: 1.96 s / 3.93 s). :func:`teardown_group` ends every NCCL backend of the
process on a thread of its own, so a round costs one communicator's teardown however many
subgroups it made (4: 0.50 s / 1.00 s), under a deadline.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from elastic_events.contract import GroupAssignment, RankContext, rank_context
from elastic_events.control import Event
from elastic_events.errors import GroupError
from elastic_events.rounds import abort


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """Everything a rank needs to join one round's process group: the round, its node's place in it, its local rank."""

    round: int
    assignment: GroupAssignment
    local_rank: int

    def __post_init__(self) -> None:
        a = self.assignment
        if not 0 <= self.local_rank < a.nproc_per_node:
            raise GroupError(f"local rank {self.local_rank} is outside the {a.nproc_per_node} ranks of a node")
        if not a.master_addr or not 0 < a.master_port < 65536:
            raise GroupError(f"round {self.round} has no master address ({a.master_addr!r}:{a.master_port})")

    @property
    def rank(self) -> int:
        return self.assignment.global_rank(self.local_rank)

    @property
    def world_size(self) -> int:
        return self.assignment.world_size

    @property
    def master_addr(self) -> str:
        return self.assignment.master_addr

    @property
    def master_port(self) -> int:
        return self.assignment.master_port

    @classmethod
    def from_event(cls, event: Event, *, local_rank: int, local_world_size: int) -> RoundSpec:
        """This rank's place in the event's round (the node must not be leaving)."""
        if event.leaves:
            raise GroupError(f"event {event.event_id} does not place this node in round {event.round}")
        assignment = GroupAssignment(
            group_rank=event.group_rank,
            group_world_size=event.group_world_size,
            nproc_per_node=local_world_size,
            master_addr=event.master_addr,
            master_port=event.master_port,
        )
        if event.world_size not in (-1, assignment.world_size):
            raise GroupError(
                f"event {event.event_id}: world size {event.world_size} is not {event.group_world_size} nodes x "
                f"{local_world_size} ranks"
            )
        return cls(round=event.round, assignment=assignment, local_rank=local_rank)


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


def init_round_group(
    spec: RoundSpec, *, device: torch.device, backend: str, timeout_s: float, forming_timeout_s: float | None = None
) -> dist.Store:
    """Join ``spec``'s process group (the default group); returns the store, to keep alive with it.

    ``timeout_s``: the group's collectives; ``forming_timeout_s`` (default the same): how long the ranks
    wait for each other while the group forms."""
    if dist.is_initialized():
        raise GroupError("a process group is still up: tear it down before joining a new round")
    forming = timedelta(seconds=forming_timeout_s if forming_timeout_s is not None else timeout_s)
    timeout = timedelta(seconds=timeout_s)
    try:
        if spec.rank == 0:
            sock = _listen_socket(spec.master_addr, spec.master_port)
            store = dist.TCPStore(
                spec.master_addr,
                spec.master_port,
                spec.world_size,
                True,
                forming,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
        else:
            wait_for_listener(spec.master_addr, spec.master_port, timeout_s=forming.total_seconds())
            store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, forming)
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
            f"{spec.master_addr}:{spec.master_port} failed or timed out (limit {forming.total_seconds():.0f}s): {exc}"
        ) from exc
    return store


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` (same arguments), formed as the rank's first round.

    :class:`~elastic_events.ElasticTraining` forms every later round itself and knows each one's
    connections, so a repair can end a gloo collective that waits on a live peer (:mod:`.abort`).
    A group the script forms with torch's own call exists before ElasticTraining does, and its
    connections are unknown: in that first round such a wait lasts until the launcher kills the
    rank, with the state it held. Formed here, the first round is like every other. (NCCL groups
    are ended through their communicators, whoever formed them.)
    """
    with abort.forming(rank_context().round):
        dist.init_process_group(*args, **kwargs)


def init_env_group(context: RankContext, *, device: torch.device, backend: str, timeout_s: float) -> bool:
    """Join the group torchrun / hyperpodrun started this process into; False without one."""
    if dist.is_initialized():
        return True
    if not context.launched:
        return False
    dist.init_process_group(
        backend, timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None
    )
    return True


#: How long the teardown of a round's groups may take before the process goes on without waiting for it.
TEARDOWN_TIMEOUT_S = 30.0


def nccl_backends() -> list[Any]:
    """Every NCCL backend of the process's process groups (none without CUDA or a group)."""
    if not dist.is_initialized() or not dist.is_nccl_available():
        return []
    found = []
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:  # the group has no CUDA backend (gloo only)
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            found.append(backend)
    return found


def end_backends(backends: Sequence[Any], how: Literal["shutdown", "abort"], *, timeout_s: float) -> list[int]:
    """``shutdown()`` (graceful: their collectives complete first) or ``abort()`` every backend, each on a
    thread of its own; returns the indices of those that did not end within ``timeout_s`` (their threads
    are left behind as daemons)."""
    threads = [
        threading.Thread(target=getattr(b, how), name=f"hyperpodrun-{how}-{i}", daemon=True)
        for i, b in enumerate(backends)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [i for i, t in enumerate(threads) if t.is_alive()]


def teardown_group(*, broken: bool = False, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Tear down the default group and every subgroup (no-op without one).

    NCCL backends are ended first, all at once (:func:`end_backends`): shut down when the round ended
    well, aborted when it is ``broken`` (destroying a communicator that waits on a dead peer blocks).
    c10d's bookkeeping is then dropped with ``destroy_process_group()``, which finds them ended. gloo
    groups fail at once when a peer's connection closes and are simply destroyed.
    """
    if not dist.is_initialized():
        return
    backends = nccl_backends()
    stuck = end_backends(backends, "abort" if broken else "shutdown", timeout_s=timeout_s) if backends else []
    if stuck:
        print(
            f"{len(stuck)} of {len(backends)} NCCL communicator(s) did not "
            f"{'abort' if broken else 'shut down'} within {timeout_s:.0f}s; going on without them",
            file=sys.stderr,
            flush=True,
        )
        if not broken:  # a graceful shutdown that blocks waits on a peer: abort what is left
            end_backends([backends[i] for i in stuck], "abort", timeout_s=timeout_s)
    dist.destroy_process_group()
