"""The node-local control channel between a hyperpodrun agent and its ranks (layout v2).

A small shared-memory file (``HYPERPODRUN_CONTROL_FILE``), created by the agent,
mapped by every local rank. No signal is sent to the ranks' process groups (that
kills dataloader workers) and nothing listens on a socket.

Layout (little-endian, fixed offsets)::

    header (256 bytes, written by the agent only)
      0  u32  magic 'HPRC'
      4  u32  layout version (2)
      8  u64  event id          (0: no event yet; increases by one per event)
     16  i64  target step       (-1: nothing pending) -- written LAST by the agent
     24  u32  event kind        (EventKind)
     28  u32  flags             (bit 0 FLAG_REPAIR: the event repairs a failure; survivors may be a step apart;
                                 bit 1 FLAG_HOLD: the event's round is below the minimum: save, then hold the state)
     32  u64  round the event leads to
     40  i64  new world size    (-1 unknown)
     48  i32  this node's group rank in the new round (-1: this node leaves the job)
     52  i32  group world size (nodes) of the new round
     56  u32  master port of the new round
     60  u32  reserved
     64  char[128] master address of the new round (utf-8, NUL-padded)
    192  ..   reserved
    slot of local rank r at 256 + 64*r (written by that rank only)
      0  i64  step              (elastic_event_detected() calls; continues across reconfigurations)
      8  f64  time.monotonic() of the last call (one clock for every process of the host)
     16  u64  id of the last event the rank acknowledged (returned True for, or was admitted by)
     24  u32  capabilities      (bit 0 CAP_RECONFIGURE: the script uses the in-process API;
                                 bit 1 CAP_LEAVE_ON_SIGTERM: SIGTERM asks to leave, it does not end the rank;
                                 bit 2 CAP_HOLD: below the minimum the rank saves and holds the state)
     28  u32  phase             (RankPhase)
     32  u64  round the rank is in
     40  i64  step of this rank's hand-off (-1 none, -2 being written; see elastic_events.rounds.handoff)
     48  f64  time.monotonic() of the last phase change
     56  u32  spare slots only: the local rank this spare replaces, plus one (0: none yet)
     60  u32  1: the rank received SIGTERM, a request to leave the job (elastic_events.termination)
    spare slots (pre-started replacements, ``elastic_events.rounds.spare``) follow the ranks' slots

A rank's check is two ``struct`` operations on mapped memory while nothing is
pending: it records its step and reads the target step. It returns True once per
event, at the first step at or past the target step (so a rank that was already
past the target when the event was published still sees it, one step late). The
agents choose the target step ahead of the fastest rank of the job (see
``hyperpodrun.events_protocol``), so every rank of every node returns True at the
same step without a per-step collective.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

MAGIC = 0x43525048  # 'HPRC'
VERSION = 2
HEADER_SIZE = 256
SLOT_SIZE = 64
NO_TARGET = -1
MASTER_ADDR_SIZE = 128
CAP_RECONFIGURE = 1
CAP_LEAVE_ON_SIGTERM = 2
CAP_HOLD = 4
FLAG_REPAIR = 1
FLAG_HOLD = 2

# magic, version, event_id, target, kind, flags, round, world, group_rank, group_world, port, reserved, addr
_HEADER = struct.Struct(f"<IIQqIIQqiiII{MASTER_ADDR_SIZE}s")
_TARGET = struct.Struct("<q")
_TARGET_OFFSET = 16
_EVENT_ID_OFFSET = 8
# step, time, acked event, capabilities, phase, round, snapshot step, phase time
_SLOT = struct.Struct("<qdQIIQqd")
_STEP = struct.Struct("<qd")  # the per-call part of a slot
_STEP_SIZE = _STEP.size
_ACK = struct.Struct("<Q")
_ACK_OFFSET = 16
_CAPS = struct.Struct("<I")
_CAPS_OFFSET = 24
_PHASE = struct.Struct("<I")
_PHASE_OFFSET = 28
_ROUND = struct.Struct("<Q")
_ROUND_OFFSET = 32
_SNAPSHOT = struct.Struct("<q")
_SNAPSHOT_OFFSET = 40
NO_SNAPSHOT = -1
SNAPSHOT_WRITING = -2
_PHASE_TIME = struct.Struct("<d")
_PHASE_TIME_OFFSET = 48
_ASSIGN = struct.Struct("<I")
_ASSIGN_OFFSET = 56
_TERM = struct.Struct("<I")
_TERM_OFFSET = 60


class EventKind(IntEnum):
    """What the ranks are asked to do at the target step."""

    NONE = 0
    SAVE_AND_EXIT = 1  # save a checkpoint and exit 0; the agent restarts the ranks at the new size
    RECONFIGURE = 2  # rebuild the process group in place for the event's round (checkpointless)


class RankPhase(IntEnum):
    """Where a rank is in its life, as the agent reads it from the rank's slot."""

    STARTING = 0
    RUNNING = 1
    PARKED = 2  # a pre-warmed joiner waiting for admission
    RECONFIGURING = 3
    READY = 4  # reconfigured into the event's round, about to take its first step there
    LEAVING = 5
    FAILED = 6
    RECOVERING = 7  # a collective failed (a peer died): waiting for the RECONFIGURE that repairs the group
    HOLDING = 8  # below the job's minimum: saved, holding the state in memory until nodes join (or it leaves)
    FINISHED = 9  # training ended on this rank: no event is acted on any more (it exits soon, 0)


class ControlChannelError(RuntimeError):
    """The control file is missing, foreign or of another layout version."""


class AdmissionTimeoutError(ControlChannelError, TimeoutError):
    """A parked rank was not admitted into a round within its timeout."""


@dataclass(frozen=True)
class Event:
    event_id: int
    target_step: int
    kind: EventKind
    round: int
    world_size: int
    group_rank: int = -1  # this node's group rank in the new round; -1: the node leaves
    group_world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    repair: bool = False  # the event repairs a failure (a rank died): survivors may be a step apart
    hold: bool = False  # the event's round is below the job's minimum: save, then hold the state until the next

    @property
    def leaves(self) -> bool:
        """Whether this node is not part of the event's round."""
        return self.group_rank < 0


@dataclass(frozen=True)
class RankProgress:
    step: int
    time: float
    acked_event: int
    capabilities: int = 0
    phase: RankPhase = RankPhase.STARTING
    round: int = 0
    snapshot_step: int = -1
    phase_time: float = 0.0

    @property
    def reconfigurable(self) -> bool:
        return bool(self.capabilities & CAP_RECONFIGURE)


def _store(mm: mmap.mmap, offset: int, layout: struct.Struct, *values: object) -> None:
    """Write fields with one copy of their bytes. ``struct.pack_into`` zeroes its region before it
    packs, so a reader in the other process could see a field at 0 mid-write: a target step of 0
    (an event firing at the wrong step), a slot's time of 0 (a stepping rank taken for hung)."""
    mm[offset : offset + layout.size] = layout.pack(*values)


def channel_size(nproc: int) -> int:
    return HEADER_SIZE + SLOT_SIZE * nproc


def _unpack_event(mm: mmap.mmap) -> Event | None:
    _, _, event_id, target, kind, flags, rnd, world, grank, gworld, port, _, addr = _HEADER.unpack_from(mm, 0)
    if target == NO_TARGET:
        return None
    master = addr.rstrip(b"\0").decode("utf-8", errors="replace")
    return Event(
        event_id,
        target,
        EventKind(kind),
        rnd,
        world,
        grank,
        gworld,
        master,
        port,
        bool(flags & FLAG_REPAIR),
        bool(flags & FLAG_HOLD),
    )


def _empty_slot() -> bytes:
    slot = bytearray(SLOT_SIZE)
    _SLOT.pack_into(slot, 0, 0, 0.0, 0, 0, RankPhase.STARTING, 0, -1, 0.0)
    return bytes(slot)


class ControlWriter:
    """Agent side: creates the file, publishes events, reads the ranks' progress."""

    def __init__(self, path: Path, nproc: int, *, spares: int = 0) -> None:
        self.path = Path(path)
        self.nproc = nproc
        self.spares = spares
        size = channel_size(nproc + spares)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _store(self._mm, 0, _HEADER, MAGIC, VERSION, 0, NO_TARGET, EventKind.NONE, 0, 0, -1, -1, 0, 0, 0, b"")
        self.reset_ranks()
        self._event_id = 0

    def reset_ranks(self) -> None:
        """Reset every rank slot and clear the pending event (before starting a new group)."""
        self._mm[HEADER_SIZE : HEADER_SIZE + SLOT_SIZE * self.nproc] = _empty_slot() * self.nproc
        _store(self._mm, _TARGET_OFFSET, _TARGET, NO_TARGET)

    def spare_slot(self, spare: int) -> int:
        """The slot index of spare ``spare`` (after the ranks' slots)."""
        if not 0 <= spare < self.spares:
            raise ValueError(f"spare must be in 0..{self.spares - 1}, got {spare}")
        return self.nproc + spare

    def reset_spare(self, spare: int) -> None:
        """An empty slot for a new spare process (no assignment)."""
        offset = HEADER_SIZE + SLOT_SIZE * self.spare_slot(spare)
        self._mm[offset : offset + SLOT_SIZE] = _empty_slot()

    def assign_spare(self, spare: int, local_rank: int) -> None:
        """Tell spare ``spare`` to become ``local_rank`` (whose slot the agent has reset)."""
        if not 0 <= local_rank < self.nproc:
            raise ValueError(f"local_rank must be in 0..{self.nproc - 1}, got {local_rank}")
        _store(self._mm, HEADER_SIZE + SLOT_SIZE * self.spare_slot(spare) + _ASSIGN_OFFSET, _ASSIGN, local_rank + 1)

    def spare_phase(self, spare: int) -> RankPhase:
        return RankPhase(
            _PHASE.unpack_from(self._mm, HEADER_SIZE + SLOT_SIZE * self.spare_slot(spare) + _PHASE_OFFSET)[0]
        )

    def reset_rank(self, local_rank: int, *, acked_event: int) -> None:
        """Reset one rank's slot (a replacement process takes it over); events up to ``acked_event`` count as seen."""
        slot = bytearray(_empty_slot())
        _ACK.pack_into(slot, _ACK_OFFSET, acked_event)
        offset = HEADER_SIZE + SLOT_SIZE * local_rank
        self._mm[offset : offset + SLOT_SIZE] = bytes(slot)

    def publish(
        self,
        *,
        event_id: int,
        target_step: int,
        kind: EventKind,
        round: int,
        world_size: int,
        group_rank: int = -1,
        group_world_size: int = 0,
        master_addr: str = "",
        master_port: int = 0,
        repair: bool = False,
        hold: bool = False,
    ) -> None:
        """Announce an event; the target step is written last so a reader never sees half an event.

        ``group_rank`` .. ``master_port`` describe the event's round for ``RECONFIGURE``
        (``group_rank`` -1: this node leaves); ``SAVE_AND_EXIT`` needs none of them.
        """
        addr = master_addr.encode("utf-8")
        if len(addr) > MASTER_ADDR_SIZE:
            raise ValueError(f"master_addr is {len(addr)} bytes in utf-8, at most {MASTER_ADDR_SIZE} fit")
        if not 0 <= master_port <= 0xFFFF:
            raise ValueError(f"master_port must be in 0..65535, got {master_port}")
        if target_step < 0:
            raise ValueError(f"target_step must be >= 0, got {target_step}")
        if kind is EventKind.RECONFIGURE and group_rank >= 0 and not (addr and master_port):
            raise ValueError("a RECONFIGURE event for a node in the new round needs master_addr and master_port")
        _store(
            self._mm,
            0,
            _HEADER,
            MAGIC,
            VERSION,
            event_id,
            NO_TARGET,
            kind,
            (FLAG_REPAIR if repair else 0) | (FLAG_HOLD if hold else 0),
            round,
            world_size,
            group_rank,
            group_world_size,
            master_port,
            0,
            addr,
        )
        _store(self._mm, _TARGET_OFFSET, _TARGET, target_step)
        self._event_id = event_id

    def clear(self) -> None:
        _store(self._mm, _TARGET_OFFSET, _TARGET, NO_TARGET)

    def termination_requests(self) -> tuple[int, ...]:
        """The local ranks that received SIGTERM (a request to leave the job) since their slot was reset."""
        return tuple(
            r for r in range(self.nproc) if _TERM.unpack_from(self._mm, HEADER_SIZE + SLOT_SIZE * r + _TERM_OFFSET)[0]
        )

    def event(self) -> Event | None:
        return _unpack_event(self._mm)

    def progress(self) -> list[RankProgress]:
        """Every rank's slot. A rank writes its slot while the agent reads it, and a read can catch
        half a write (a step thousands of times a second makes that likely): a slot is taken only
        when two reads in a row agree."""
        out = []
        for r in range(self.nproc):
            offset = HEADER_SIZE + SLOT_SIZE * r
            fields = _SLOT.unpack_from(self._mm, offset)
            for _ in range(100):
                again = _SLOT.unpack_from(self._mm, offset)
                if again == fields:
                    break
                fields = again
            step, t, acked, caps, phase, rnd, snap, phase_t = fields
            out.append(RankProgress(step, t, acked, caps, RankPhase(phase), rnd, snap, phase_t))
        return out

    def close(self) -> None:
        self._mm.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class ControlReader:
    """Rank side: maps the file; :meth:`check` is the per-step call."""

    def __init__(self, path: str | os.PathLike[str], local_rank: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ControlChannelError(f"cannot open control file {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise ControlChannelError(f"control file {path} is not a hyperpodrun v{VERSION} control channel")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<II", self._mm, 0)
        if magic != MAGIC or version != VERSION:
            raise ControlChannelError(f"control file {path} is not a hyperpodrun v{VERSION} control channel")
        if size < channel_size(local_rank + 1):
            raise ControlChannelError(f"control file {path} has no slot for local rank {local_rank}")
        self._slot = HEADER_SIZE + SLOT_SIZE * local_rank
        self.step = 0
        self._acked = _ACK.unpack_from(self._mm, self._slot + _ACK_OFFSET)[0]
        self.fired: Event | None = None  # the event check() last returned True for

    def check(self) -> bool:
        """Count one step; True once per event, at the first step at or past its target step."""
        step = self.step + 1
        self.step = step
        mm, slot = self._mm, self._slot
        mm[slot : slot + _STEP_SIZE] = _STEP.pack(step, time.monotonic())  # one copy: see _store
        target = _TARGET.unpack_from(mm, _TARGET_OFFSET)[0]
        if target < 0 or target > step:
            return False
        event_id = _ACK.unpack_from(mm, _EVENT_ID_OFFSET)[0]
        if event_id == self._acked:
            return False
        self.acknowledge(event_id)
        self.fired = _unpack_event(mm)
        return True

    def acknowledge(self, event_id: int) -> None:
        """Mark ``event_id`` as seen: :meth:`check` will not return True for it."""
        self._acked = event_id
        _store(self._mm, self._slot + _ACK_OFFSET, _ACK, event_id)

    def set_step(self, step: int) -> None:
        """Continue counting from ``step`` (a joiner adopts its peers' count at admission)."""
        self.step = step
        _store(self._mm, self._slot, _STEP, step, time.monotonic())

    def declare(self, capabilities: int) -> None:
        """Add ``capabilities`` (e.g. :data:`CAP_RECONFIGURE`) to what the agent sees of this rank."""
        caps = _CAPS.unpack_from(self._mm, self._slot + _CAPS_OFFSET)[0]
        _store(self._mm, self._slot + _CAPS_OFFSET, _CAPS, caps | capabilities)

    def set_phase(self, phase: RankPhase, *, round: int | None = None) -> None:
        """Record a phase change (round first, phase last: a reader never sees READY with a stale round)."""
        if round is not None:
            _store(self._mm, self._slot + _ROUND_OFFSET, _ROUND, round)
        _store(self._mm, self._slot + _PHASE_TIME_OFFSET, _PHASE_TIME, time.monotonic())
        _store(self._mm, self._slot + _PHASE_OFFSET, _PHASE, phase)

    def request_termination(self) -> None:
        """Tell the agent that this rank received SIGTERM: a request to leave the job at the next agreed step."""
        _store(self._mm, self._slot + _TERM_OFFSET, _TERM, 1)

    def set_snapshot_step(self, step: int) -> None:
        """Record the step of the state this rank holds outside the process (``SNAPSHOT_WRITING``: being written)."""
        _store(self._mm, self._slot + _SNAPSHOT_OFFSET, _SNAPSHOT, step)

    def assignment(self) -> int | None:
        """A spare's slot: the local rank it was told to become (None: not yet)."""
        value = _ASSIGN.unpack_from(self._mm, self._slot + _ASSIGN_OFFSET)[0]
        return value - 1 if value else None

    def progress(self) -> RankProgress:
        """This rank's own slot, as the agent reads it."""
        step, t, acked, caps, phase, rnd, snap, phase_t = _SLOT.unpack_from(self._mm, self._slot)
        return RankProgress(step, t, acked, caps, RankPhase(phase), rnd, snap, phase_t)

    def event(self) -> Event | None:
        return _unpack_event(self._mm)

    def wait_for_admission(
        self,
        *,
        timeout_s: float,
        poll_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Event:
        """Park until a ``RECONFIGURE`` event places this node in a round (``group_rank >= 0``).

        Marks the rank PARKED and polls the header every ``poll_s``; the admitting event
        is acknowledged (so :meth:`check` does not return True for it later). Raises
        :class:`AdmissionTimeoutError` after ``timeout_s``.
        """
        return self.wait_for_reconfigure(
            RankPhase.PARKED,
            timeout_s=timeout_s,
            poll_s=poll_s,
            clock=clock,
            sleep=sleep,
            placed_only=True,
            what="parked rank was not admitted into a round",
        )

    def wait_for_reconfigure(
        self,
        phase: RankPhase,
        *,
        timeout_s: float,
        what: str,
        poll_s: float = 0.005,
        placed_only: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Event:
        """Mark the rank ``phase`` and wait for a ``RECONFIGURE`` event it has not seen (acknowledged on return).

        ``placed_only``: only an event that places this node in its round. Raises
        :class:`AdmissionTimeoutError` (``what`` says who waited) after ``timeout_s``.
        """
        self.set_phase(phase)
        deadline = clock() + timeout_s
        while True:
            event = self.event()
            if event is not None and event.kind is EventKind.RECONFIGURE and not (placed_only and event.leaves):
                if event.event_id != self._acked:
                    self.acknowledge(event.event_id)
                    return event
            if clock() >= deadline:
                raise AdmissionTimeoutError(
                    f"{what} within {timeout_s:.0f}s (no RECONFIGURE event"
                    f"{' placing this node' if placed_only else ''} appeared on the control channel)"
                )
            sleep(poll_s)
