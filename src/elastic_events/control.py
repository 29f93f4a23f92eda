"""The node-local control channel between a hyperpodrun agent and its ranks.

A small shared-memory file (``HYPERPODRUN_CONTROL_FILE``), created by the agent,
mapped by every local rank. No signal is sent to the ranks' process groups (that
kills dataloader workers) and nothing listens on a socket.

Layout (little-endian, fixed offsets)::

    header (64 bytes)
      0  u32  magic 'HPRC'
      4  u32  layout version
      8  u64  event id          (0: no event yet; increases by one per event)
     16  i64  target step       (-1: nothing pending) -- written LAST by the agent
     24  u32  event kind        (EventKind)
     28  u32  reserved
     32  u64  round the event leads to
     40  i64  new world size    (-1 unknown)
     48  ..   reserved (new rank assignment for in-place reconfiguration goes here)
    slot of local rank r at 64 + 64*r (written by that rank only)
      0  i64  step              (number of elastic_event_detected() calls so far)
      8  f64  unix time of the last call
     16  u64  id of the last event the rank acknowledged (returned True for)

A rank's check is two ``struct`` operations on mapped memory: it records its
step and reads the target step; it returns True exactly when its step equals the
target. The agents choose the target step ahead of the fastest rank of the job
(see ``hyperpodrun.events_protocol``), so every rank of every node returns True at
the same step without a per-step collective.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

MAGIC = 0x43525048  # 'HPRC'
VERSION = 1
HEADER_SIZE = 64
SLOT_SIZE = 64
NO_TARGET = -1

_HEADER = struct.Struct("<IIQqIIQq")  # magic, version, event_id, target, kind, reserved, round, world
_TARGET = struct.Struct("<q")
_TARGET_OFFSET = 16
_SLOT = struct.Struct("<qdQ")  # step, time, acked event
_STEP = struct.Struct("<qd")  # the per-call part of a slot
_ACK = struct.Struct("<Q")


class EventKind(IntEnum):
    """What the ranks are asked to do at the target step."""

    NONE = 0
    SAVE_AND_EXIT = 1  # save a checkpoint and exit 0; the agent restarts the ranks at the new size
    RECONFIGURE = 2  # reserved: rebuild the process group in place (checkpointless operation)


class ControlChannelError(RuntimeError):
    """The control file is missing, foreign or of another layout version."""


@dataclass(frozen=True)
class Event:
    event_id: int
    target_step: int
    kind: EventKind
    round: int
    world_size: int


@dataclass(frozen=True)
class RankProgress:
    step: int
    time: float
    acked_event: int


def channel_size(nproc: int) -> int:
    return HEADER_SIZE + SLOT_SIZE * nproc


class ControlWriter:
    """Agent side: creates the file, publishes events, reads the ranks' progress."""

    def __init__(self, path: Path, nproc: int) -> None:
        self.path = Path(path)
        self.nproc = nproc
        size = channel_size(nproc)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._mm, 0, MAGIC, VERSION, 0, NO_TARGET, EventKind.NONE, 0, 0, -1)
        self._event_id = 0

    def reset_ranks(self) -> None:
        """Zero every rank slot and clear the pending event (before starting a new group)."""
        self._mm[HEADER_SIZE:] = bytes(SLOT_SIZE * self.nproc)
        _TARGET.pack_into(self._mm, _TARGET_OFFSET, NO_TARGET)

    def publish(self, *, event_id: int, target_step: int, kind: EventKind, round: int, world_size: int) -> None:
        """Announce an event; the target step is written last so a reader never sees half an event."""
        _HEADER.pack_into(self._mm, 0, MAGIC, VERSION, event_id, NO_TARGET, kind, 0, round, world_size)
        _TARGET.pack_into(self._mm, _TARGET_OFFSET, target_step)
        self._event_id = event_id

    def clear(self) -> None:
        _TARGET.pack_into(self._mm, _TARGET_OFFSET, NO_TARGET)

    def event(self) -> Event | None:
        _, _, event_id, target, kind, _, rnd, world = _HEADER.unpack_from(self._mm, 0)
        if target == NO_TARGET:
            return None
        return Event(event_id, target, EventKind(kind), rnd, world)

    def progress(self) -> list[RankProgress]:
        return [RankProgress(*_SLOT.unpack_from(self._mm, HEADER_SIZE + SLOT_SIZE * r)) for r in range(self.nproc)]

    def close(self) -> None:
        self._mm.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class ControlReader:
    """Rank side: maps the file; :meth:`check` is the per-step call."""

    def __init__(self, path: Path, local_rank: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ControlChannelError(f"cannot open control file {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < channel_size(local_rank + 1):
                raise ControlChannelError(f"control file {path} has no slot for local rank {local_rank}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<II", self._mm, 0)
        if magic != MAGIC or version != VERSION:
            raise ControlChannelError(f"control file {path} is not a hyperpodrun v{VERSION} control channel")
        self._slot = HEADER_SIZE + SLOT_SIZE * local_rank
        self.step = 0

    def check(self) -> bool:
        """Count one step; True when this step is the target step of a pending event."""
        step = self.step + 1
        self.step = step
        mm = self._mm
        _STEP.pack_into(mm, self._slot, step, time.time())
        if _TARGET.unpack_from(mm, _TARGET_OFFSET)[0] != step:
            return False
        _ACK.pack_into(mm, self._slot + 16, _ACK.unpack_from(mm, 8)[0])
        return True

    def event(self) -> Event | None:
        _, _, event_id, target, kind, _, rnd, world = _HEADER.unpack_from(self._mm, 0)
        if target == NO_TARGET:
            return None
        return Event(event_id, target, EventKind(kind), rnd, world)
