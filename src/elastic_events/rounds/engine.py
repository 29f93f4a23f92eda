"""The round engine: one process's place in the job's rounds, and the moves between them.

A *round* is one process group of the job's ranks. :class:`RoundEngine` holds what a rank knows of
its current round (number, rank, world, the group's store and side groups) in memory and performs
the moves every user of the in-process API shares, :class:`~elastic_events.ElasticTraining` and the
Hugging Face and Lightning integrations alike:

* **start**: join the group the launcher started the process into (:meth:`start_group`), or, for a
  parked joiner, wait to be admitted into a round (:meth:`wait_for_admission`);
* **form**: join an event's round (:meth:`form`): the device of this rank, the round's group, the
  watchdog that ends a broken round's collectives (:mod:`.watchdog`);
* **agree**: every rank reports what it holds, every rank gets every report (:meth:`agree`);
* **transfer**: one source streams a replicated state to the newcomers (:meth:`transfer`);
* **commit**: a step is applied only if its collectives completed (:attr:`commit`, :mod:`.commit`);
* **recover**: a step failed; is it a peer's failure (:meth:`peer_failure`), and which repaired
  round carries this rank on (:meth:`wait_for_repair`);
* **release**: leave the round (:meth:`release`): graceful, or aborted when it is broken.

What is moved (a replicated model, a sharded one, a framework's payload) is the caller's business.
The engine never writes the process's environment: its round is :attr:`round`, its place
:attr:`rank` of :attr:`world_size`, and event-log records follow it (:func:`.eventlog.enter_round`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import elastic_events
from elastic_events import eventlog
from elastic_events.contract import RankContext, Record, rank_context, rank_environment
from elastic_events.control import AdmissionTimeoutError, ControlReader, Event, EventKind, RankPhase
from elastic_events.errors import ElasticTrainingError, PeerFailureError, RecoveryError
from elastic_events.rounds import abort
from elastic_events.rounds.commit import StepCommit, cuda_fence
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.group import RoundSpec, init_env_group, init_round_group, teardown_group
from elastic_events.rounds.hydration import allocate_tensors, collective_failures, model_tensors, split_tensors
from elastic_events.rounds.mesh import MeshLayout, build_mesh, plan_layout
from elastic_events.rounds.transfer import broadcast_tensors
from elastic_events.rounds.watchdog import Watchdog, abort_for

__all__ = ["RoundEngine", "backend_for", "rank_device"]


def rank_device(local_rank: int) -> torch.device:
    """The device of local rank ``local_rank``: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.

    One GPU per rank: a node whose visible GPUs are fewer than its ranks is refused, not shared.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ElasticTrainingError(
            f"local rank {local_rank} has no GPU of its own: {count} visible (CUDA_VISIBLE_DEVICES); "
            "start at most one rank per GPU, or pass ElasticConfig(device='cpu')"
        )
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class RoundEngine:
    """One process's side of the job's rounds (see the module)."""

    def __init__(
        self,
        config: ElasticConfig | None = None,
        *,
        context: RankContext | None = None,
        reader: ControlReader | None = None,
    ) -> None:
        self.config = config or ElasticConfig()
        self.context = context or rank_context()
        self.reader = reader if reader is not None else elastic_events._channel()
        self.local_rank, self.local_world_size = self.context.local_rank, self.context.local_world_size
        self.device = torch.device(self.config.device) if self.config.device else rank_device(self.local_rank)
        self.backend = self.config.backend or backend_for(self.device)
        self.round = self.context.round
        self.assignment = self.context.assignment  # where this node sits in the current round
        self._store: Any = None  # the round's TCPStore: lives as long as its group
        self._side: tuple[Any, Any, set[int]] | None = None  # the round's gloo side groups, and their sockets
        self._mesh: Any = None  # the round's HSDP DeviceMesh, once built
        self._watchdog: Watchdog | None = None
        self._abort = abort_for(self.backend)
        self._lock = threading.Lock()
        self._broken: tuple[int, str] | None = None  # (round, why) once a round is known broken
        self._step_s: float | None = None  # smoothed seconds per step, for the collective deadline
        self._last_step: float | None = None
        self.commit: StepCommit | None = None  # under a launcher only: without one no step is ever repaired
        if self.config.commit_check and self.reader is not None:
            self.commit = StepCommit(
                fence=lambda: cuda_fence(self.device),
                broken=self.broken,
                deadline_s=self.collective_deadline_s,
                abort=self.abort_round,
            )

    # ------------------------------------------------------------------ where it is
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    @property
    def comm_device(self) -> torch.device:
        """Where tensors travel: the GPU with NCCL, the CPU with gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def torchrun_environment(self) -> dict[str, str]:
        """torchrun's variables of this rank in the current round (for a process or a framework that reads them)."""
        return rank_environment(self.assignment, self.local_rank, round=self.round)

    def set_phase(self, phase: RankPhase, *, round: int | None = None) -> None:
        """What the agent reads of this rank (no-op outside hyperpodrun)."""
        if self.reader is not None:
            self.reader.set_phase(phase, round=self.round if round is None else round)

    def take_event(self) -> Event | None:
        """The event ``elastic_event_detected()`` last returned True for (taken: asked once)."""
        if self.reader is None:
            return None
        event, self.reader.fired = self.reader.fired, None
        return event

    # ------------------------------------------------------------------ start
    def _use_device(self) -> None:
        """One device per rank, made current before any collective (a CUDA context from here on)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def start_group(self) -> bool:
        """Join the group torchrun / hyperpodrun started this process into; False without one."""
        self._use_device()
        if dist.is_initialized():  # the script formed it
            if self.reader is not None and abort.current_round() != self.round and "gloo" in str(dist.get_backend()):
                print(
                    f"rank {self.rank}: the process group was formed by torch.distributed.init_process_group, so in "
                    "this first round a repair cannot end a gloo collective that waits on a live peer (the launcher "
                    "kills the rank instead); elastic_events.init_process_group (same arguments) forms it as a round",
                    file=sys.stderr,
                    flush=True,
                )
            up = True
        else:
            with abort.forming(self.round):
                up = init_env_group(
                    self.context, device=self.device, backend=self.backend, timeout_s=self.config.timeout_s
                )
        if up:
            self._entered()
        return up

    def wait_for_admission(self) -> Event:
        """A parked joiner: wait until a ``RECONFIGURE`` event places this node in a round."""
        if self.reader is None:
            raise ElasticTrainingError("a parked rank needs the control channel: only hyperpodrun parks ranks")
        return self.reader.wait_for_admission(timeout_s=self.config.admission_timeout_s, poll_s=self.config.poll_s)

    # ------------------------------------------------------------------ form, release
    def form(self, event: Event, *, step: int, torn_down_s: float = 0.0) -> RoundSpec:
        """Join ``event``'s round: its group, this rank's device, the watchdog."""
        spec = RoundSpec.from_event(event, local_rank=self.local_rank, local_world_size=self.local_world_size)
        eventlog.enter_round(
            round=spec.round, rank=spec.rank, world_size=spec.world_size
        )  # its records: the new round's
        eventlog.emit(Record.GROUP_TORN_DOWN, event_id=event.event_id, step=step, seconds=torn_down_s)
        self._use_device()
        t0 = time.monotonic()
        # a repaired round may lose another member while it forms: its wait is the repair's, not a scale event's
        forming_s = min(self.config.timeout_s, self.config.recover_timeout_s) if event.repair else self.config.timeout_s
        with abort.forming(event.round):
            self._store = init_round_group(
                spec,
                device=self.device,
                backend=self.backend,
                timeout_s=self.config.timeout_s,
                forming_timeout_s=forming_s,
            )
        self.round, self.assignment = event.round, spec.assignment
        self._entered()
        eventlog.emit(Record.GROUP_UP, event_id=event.event_id, seconds=time.monotonic() - t0)
        return spec

    def _entered(self) -> None:
        eventlog.enter_round(round=self.round, rank=self.rank, world_size=self.world_size)
        if self._watchdog is None and self.reader is not None:
            self._watchdog = Watchdog(
                self.reader, abort=self._abort, on_broken=self._mark_broken, rank=lambda: self.rank
            ).start()

    def watch_blocked(self, on_blocked: Callable[[Event], None]) -> None:
        """Call ``on_blocked(event)`` once when the main thread stays blocked in a round being repaired."""
        if self._watchdog is not None:
            self._watchdog._on_blocked = on_blocked

    def release(self, *, broken: bool = False) -> float:
        """Leave the current round (``broken``: a peer failed; its collectives are aborted, never awaited).
        Returns the seconds it took."""
        t0 = time.monotonic()
        broken = broken or self.broken() is not None
        if broken and self.backend == "gloo":  # its sockets outlive the group while anything holds it
            abort.shutdown_round(self.round)
        teardown_group(broken=broken)
        self._store, self._side, self._mesh = None, None, None
        return time.monotonic() - t0

    def side_group(self) -> tuple[Any, Any, set[int]]:
        """This round's two gloo groups for snapshots (bytes, and acknowledgements) and their sockets,
        made once per round; idle between snapshots, so only failures end their waits."""
        if self._side is None:
            sockets: set[int] = set()
            timeout = timedelta(seconds=max(self.config.timeout_s, 86_400))
            with abort.tracking(sockets):
                group = dist.new_group(backend="gloo", timeout=timeout)
                acks = dist.new_group(backend="gloo", timeout=timeout)
            self._side = (group, acks, sockets)
        return self._side

    def layout(self, world_size: int | None = None) -> MeshLayout | None:
        """The HSDP layout of the current round (or of a world of ``world_size``); None without HSDP or a group.
        Raises :class:`~elastic_events.rounds.mesh.MeshLayoutError` when the world is not whole replicas."""
        hsdp = self.config.hsdp
        if hsdp is None or not self.distributed:
            return None
        world = self.world_size if world_size is None else world_size
        return plan_layout(hsdp, world_size=world, local_world_size=self.local_world_size)

    def mesh(self) -> Any:
        """The current round's HSDP ``DeviceMesh`` (built the first time: collective), or None without HSDP."""
        layout = self.layout()
        if layout is None:
            return None
        if self._mesh is None:
            with abort.tracking():  # its subgroups' sockets are the round's: a repair's abort shuts them down too
                self._mesh = build_mesh(layout, self.device)
        return self._mesh

    def close(self) -> None:
        """Stop the watchdog and leave the group (at the end of training, or at interpreter exit)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.distributed:
            self.release()

    # ------------------------------------------------------------------ agree, transfer
    def agree(self, report: Any, *, error: type[Exception]) -> list[Any]:
        """Every rank's ``report``, in rank order, on every rank; a failure raises ``error``."""
        reports: list[Any] = [None] * self.world_size
        with self.collectives(error):
            dist.all_gather_object(reports, report)
        return reports

    def collectives(self, error: type[Exception]) -> Any:
        """A block of the round's collectives whose failure raises ``error`` naming this rank and round."""
        return collective_failures(
            error, rank=self.rank, round=self.round, world_size=self.world_size, timeout_s=self.config.timeout_s
        )

    def transfer(self, source: int, newcomers: tuple[int, ...], *, module: torch.nn.Module, payload: Any) -> Any:
        """``source`` streams ``module``'s tensors into the newcomers' own and ``payload`` (any picklable
        structure holding tensors) as one skeleton plus tensors; returns the payload on every member.
        Every rank of the round calls it (the subgroup of the source and the newcomers is collective)."""
        if not newcomers:
            return payload
        members = sorted((source, *newcomers))
        timeout = timedelta(seconds=self.config.timeout_s)
        group = None if len(members) == self.world_size else dist.new_group(members, timeout=timeout)
        if self.rank not in members:
            return payload
        sending = self.rank == source
        box: list[Any] = [None]
        tensors: list[torch.Tensor] = []
        if sending:
            box[0], tensors = split_tensors(payload)
        dist.broadcast_object_list(box, src=source, group=group)
        if not sending:
            payload, tensors = allocate_tensors(box[0], self.device)
        broadcast_tensors(
            [*(t for _, t in model_tensors(module)), *tensors],
            src=source,
            group=group,
            device=self.comm_device,
            bucket_bytes=self.config.bucket_bytes,
        )
        return payload

    # ------------------------------------------------------------------ failures
    def _mark_broken(self, round: int, why: str) -> None:
        with self._lock:
            if self._broken is None or self._broken[0] != round:
                self._broken = (round, why)

    def broken(self) -> str | None:
        """Why the current round is broken (aborted, or its repair published), or None."""
        with self._lock:
            if self._broken is not None and self._broken[0] == self.round:
                return self._broken[1]
        return self.repair_pending()

    def repair_pending(self) -> str | None:
        """Why this rank's round is broken, if its launcher published a repair of it."""
        event = self.reader.event() if self.reader is not None else None
        if event is not None and event.kind is EventKind.RECONFIGURE and event.repair and event.round > self.round:
            return f"the launcher repairs round {self.round} (event {event.event_id}): a peer failed"
        return None

    def abort_round(self, why: str) -> None:
        """End every collective of the current round now (the commit check's deadline passed)."""
        self._mark_broken(self.round, why)
        print(f"rank {self.rank}: aborting round {self.round}: {why}", file=sys.stderr, flush=True)
        self._abort(self.round)

    def note_step(self) -> None:
        """A step ended: the step time the collective deadline scales with."""
        now = time.monotonic()
        if self._last_step is not None:
            took = now - self._last_step
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
        self._last_step = now

    def collective_deadline_s(self) -> float:
        c = self.config
        return max(c.collective_timeout_s, c.collective_timeout_steps * (self._step_s or 0.0))

    def peer_failure(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a step of the current round, is another rank's failure.

        Decided by what the rank knows of its round, not by what a message says: a c10d error
        (``DistError``: NCCL's errors, store and network errors), a step the commit check abandoned,
        a round the watchdog aborted or the launcher is repairing, or, for gloo (whose errors are
        plain ``RuntimeError``s), a connection of the round that a peer closed. A ``RuntimeError``
        with none of these waits up to ``peer_failure_grace_s`` for one (the launcher learns of a
        lost node from its lease) before it counts as the script's own error.
        """
        if isinstance(exc, ElasticTrainingError) or not self.distributed:
            return False
        if isinstance(exc, (dist.DistError, PeerFailureError)):
            return True
        if not isinstance(exc, RuntimeError):
            return False
        deadline = time.monotonic() + self.config.peer_failure_grace_s
        while True:
            if self.broken() is not None or abort.peer_closed(self.round):
                return True
            if time.monotonic() >= deadline:
                print(
                    f"rank {self.rank}: {type(exc).__name__} in round {self.round} with no sign of a peer's failure "
                    f"within {self.config.peer_failure_grace_s:g}s: the script's own error",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            time.sleep(self.config.poll_s)

    def wait_for_repair(self, *, failed_step: int) -> Event:
        """A peer failed: drop the broken round, then wait for the launcher's repaired round."""
        if self.reader is None:
            raise RecoveryError("no launcher to repair the group")
        try:
            return self.reader.wait_for_reconfigure(
                RankPhase.RECOVERING,
                timeout_s=self.config.recover_timeout_s,
                poll_s=self.config.poll_s,
                what=f"rank {self.rank} (its collective failed at step {failed_step}) was not carried into a "
                "repaired group",
            )
        except AdmissionTimeoutError as timeout:
            self.set_phase(RankPhase.FAILED)
            raise RecoveryError(str(timeout)) from None

    def new_round(self, reason: str) -> None:
        """The next ``elastic_event_detected()`` ends the first step of a new round: log it."""
        elastic_events._new_round(reason)
