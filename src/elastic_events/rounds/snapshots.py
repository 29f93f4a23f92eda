"""When a sharded model is snapshotted in memory, and by whom: :class:`Snapshots` drives one round's
:class:`~elastic_events.rounds.snapshot.Replicator` for :class:`~elastic_events.ElasticTraining`.

Under a launcher, with a sharded (FSDP2) model on two or more ranks, every rank's shards are copied
every ``snapshot_every`` steps and kept by a peer, so that a failed rank's shards exist somewhere
else. The round's first state is snapshotted at once (a failure in its first step is covered too);
no optimizer step is taken before the last snapshot's copies exist (:meth:`Snapshots.wait`, a
pre-step hook), and the optimizer's state is captured again when it appears (its first step).

With ``snapshot_every="auto"`` each round snapshots every other step after its first until it has
timed :data:`~elastic_events.rounds.snapshot_interval.CALIBRATION_STEPS` steps with a snapshot beside
them and as many without; the ranks then agree on the largest cost and
:func:`~elastic_events.rounds.snapshot_interval.choose_interval` sets the round's interval.
"""

from __future__ import annotations

import sys
import time

from elastic_events import eventlog
from elastic_events.contract import AUTO, Record
from elastic_events.rounds.engine import RoundEngine
from elastic_events.rounds.own_copy import OwnCopy
from elastic_events.rounds.snapshot import (
    Captured,
    Piece,
    Replicator,
    SnapshotError,
    capture,
    optimizer_state_count,
)
from elastic_events.rounds.snapshot_interval import Calibration, IntervalChoice, choose_interval
from elastic_events.training_state import TrainState

__all__ = ["Snapshots"]


class Snapshots:
    """One rank's in-memory snapshots of a sharded model, round after round."""

    def __init__(self, engine: RoundEngine, state: TrainState) -> None:
        self.engine, self.state = engine, state
        setting = engine.config.snapshot_interval
        self.auto = setting == AUTO
        self.every = 1 if setting == AUTO else int(setting)  # steps between snapshots; auto: this round's
        self.choice: IntervalChoice | None = None  # auto: this round's choice, once made
        self.replicator: Replicator | None = None  # this round's, while snapshots are taken
        self.captured: Captured | None = None  # the local state's live tensors
        self._calibration: Calibration | None = None  # auto: this round's timings until the choice
        self._last_take: float | None = None  # auto: when take() last returned (monotonic)
        self._snapshot_step = 0  # the step of this round's last snapshot
        self._carrying = False  # the step under way has the last snapshot streaming beside it
        self.replicas = False  # HSDP with 2 replicas or more this round: live state described, no copies
        self.own: OwnCopy | None = None  # HSDP with 2 replicas or more: the local state before the last step
        self._written: tuple[Captured | None, frozenset[int]] = (None, frozenset())  # its buffers' data pointers
        self._own_started: int | None = None  # the optimizer steps ended when the copy one step back last started

    def start(self) -> None:
        """Start this round's snapshots if they apply (collective: every rank decides the same way).

        HSDP with two replicas or more: the other replicas hold every shard, so nothing is sent; the
        live local state is described (:attr:`replicas`), for a failure's repair to send from, and copied
        locally after each optimizer step (:attr:`own`, :mod:`.own_copy`)."""
        e, s = self.engine, self.state
        if self.own is not None:
            self.own.close()
        self.replicas, self.own, self._own_started = False, None, None
        if e.reader is None or not e.distributed or e.world_size < 2 or not s.sharded:
            return
        layout = e.layout()
        if layout is not None and layout.replicas >= 2:
            self.captured, self.replicas, self.own = capture(s.built_model(), s.optimizer), True, OwnCopy()
            if e.rank == 0:
                print(
                    f"round {e.round}: {layout.describe()}: no in-memory snapshots, another replica holds every "
                    "shard (each rank keeps its own state of one step back)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if self.every == 0:
            return
        if layout is not None and e.rank == 0:
            print(
                f"round {e.round}: {layout.describe()}: one replica, so in-memory snapshots as for FSDP "
                f"(snapshot_every={'auto' if self.auto else self.every}) repair a failure",
                file=sys.stderr,
                flush=True,
            )
        try:
            self.captured = capture(s.built_model(), s.optimizer)
        except SnapshotError as exc:
            print(f"rank {e.rank}: no in-memory snapshots: {exc}", file=sys.stderr, flush=True)
            return
        group, acks, sockets = e.side_group()
        self.replicator = Replicator(
            group=group,
            acks=acks,
            sockets=sockets,
            round=e.round,
            rank=e.rank,
            world_size=e.world_size,
            local_world_size=e.local_world_size,
            bucket_bytes=e.config.bucket_bytes,
            timeout_s=e.config.timeout_s,
        )
        if self.auto:
            self.every, self.choice, self._calibration = 1, None, Calibration.empty()
        self._last_take = None
        self.take(every=1)
        self._last_take = None  # the round's first step (a new loader iterator, the first snapshot) is not timed

    def take(self, every: int | None = None) -> None:
        """After step :attr:`TrainState.step`: snapshot it in the background, if it is one to keep. HSDP with
        replicas: start the copy one step back of the state the step left."""
        if self.own is not None:
            self._start_own()
        replicator, s = self.replicator, self.state
        if replicator is None:
            return
        calibration = self._calibration
        if calibration is None:
            due = not s.step % (every or self.every)
        elif self._last_take is None:  # not timed: the round's start or its first step
            due = True
        else:
            calibration.add(time.monotonic() - self._last_take, carried=self._carrying)
            if calibration.done:
                self._choose(calibration)
                # every multiple of the interval from here on; now as well if the first multiple would leave more
                # than the interval since the last snapshot (a failure redoes at most the interval's steps)
                first = s.step + (-s.step % self.every)
                due = first == s.step or first - self._snapshot_step > self.every
            else:
                due = not self._carrying  # while timing, every other step carries a snapshot
        if replicator.failed is None and due:
            replicator.snapshot(self.piece(s.step))
            self._snapshot_step = s.step
        self._carrying = due
        self._last_take = time.monotonic()

    def _start_own(self) -> None:
        """Start the copy one step back (:meth:`OwnCopy.start`) of the state the last optimizer step left, once
        per optimizer step, at the step's end: what the script changed after ``optimizer.step()`` is in it.
        Sealed in the next optimizer's pre-step hook (:meth:`wait`); without this call, copied there."""
        own, s = self.own, self.state
        ended = s.optimizer_steps[1]
        if own is None or self._own_started == ended:
            return
        c = self.live()
        if self._written[0] is not c:  # the model's buffers, which a forward may write
            self._written = (c, frozenset(b.data_ptr() for b in s.built_model().buffers()))
        own.start(c.layout, c.tensors, forward_written=self._written[1])
        self._own_started = ended

    def _choose(self, calibration: Calibration) -> None:
        """``auto``: the round's interval from every rank's timings (collective: all ranks are here at the
        same step, having timed the same snapshots)."""
        e = self.engine
        try:
            reports = e.agree(calibration.report(), error=SnapshotError)
        except SnapshotError as exc:  # a peer failed: the round is broken, its next step's collective says so
            self.every, self._calibration = 1, None
            print(f"rank {e.rank}: no snapshot interval chosen in round {e.round} ({exc}): every step", file=sys.stderr)
            return
        choice = choose_interval(
            cost_s=max(cost for cost, _ in reports),
            step_s=min(step for _, step in reports),
            target=e.config.snapshot_overhead,
            mtbf_s=e.config.mtbf_s,
        )
        self.every, self.choice, self._calibration = choice.every, choice, None
        if e.rank == 0:
            print(f"round {e.round}: {choice.describe()}", file=sys.stderr, flush=True)
        eventlog.emit(
            Record.SNAPSHOT_INTERVAL,
            step=self.state.step,
            every=choice.every,
            cost_s=round(choice.cost_s, 6),
            step_s=round(choice.step_s, 6),
            overhead=round(choice.overhead, 6),
            target=choice.target,
            mtbf_s=choice.mtbf_s,
            rule=choice.rule,
        )

    def piece(self, step: int) -> Piece:
        """This rank's live state at ``step``, as a snapshot piece."""
        e, s, c = self.engine, self.state, self.captured
        if c is None:
            raise SnapshotError(f"rank {e.rank}: no local state captured to snapshot at step {step}")
        return Piece(
            owner=e.rank,
            round=e.round,
            world_size=e.world_size,
            step=step,
            layout=c.layout,
            small=s.small_state(control_step=e.reader.step if e.reader is not None else 0),
            param_groups=c.param_groups(s.optimizer),
            tensors=c.tensors,
        )

    def one_step_back(self, step: int) -> Piece | None:
        """HSDP with replicas: this rank's copy of its local state before its last optimizer step, if older
        than ``step`` (the live state is at ``step``)."""
        back = self.own.piece() if self.own is not None else None
        return back if back is not None and back.step < step else None

    def live(self) -> Captured:
        """The local state's live tensors (:attr:`captured`), captured again if the optimizer's state changed."""
        c, s = self.captured, self.state
        if c is None or c.count != optimizer_state_count(s.optimizer):
            c = self.captured = capture(s.built_model(), s.optimizer)
        return c

    def recapture(self) -> None:
        """The optimizer's post-step hook: its state appears at its first step (every shard is sharded here)."""
        if self.replicator is not None or self.replicas:
            self.live()

    def wait(self) -> None:
        """The optimizer's pre-step hook: no step is committed before every copy of the last snapshot exists
        (and the live tensors being sent must not change yet). A peer's failure raises ``PeerFailureError``.
        HSDP with replicas: the copy of the local state started after the last step is sealed as the state
        at this one, before the step changes it."""
        if self.replicator is not None:
            self.replicator.wait(broken=self.engine.broken)
        if self.own is not None:
            self.own.seal(self.piece(self.state.step))

    def stop(self, *, broken: bool) -> Replicator | None:
        """End this round's replication (``broken``: at once, keeping what is held) and return it."""
        replicator, self.replicator = self.replicator, None
        if replicator is None:
            return None
        if broken:
            replicator.abort()
        elif not replicator.close(timeout_s=self.engine.config.timeout_s):
            print(
                f"rank {self.engine.rank}: snapshot threads of round {replicator.round} did not end within "
                f"{self.engine.config.timeout_s:.0f}s; their group was shut down",
                file=sys.stderr,
                flush=True,
            )
        return replicator

    def stats(self) -> dict[str, int]:
        """Bytes of this rank's local state, bytes of snapshots it holds (its neighbour's two and its own),
        snapshots completed this round, and how long the last one's chain took (µs: sent to the holder
        until every rank's copy existed; 0 before the first)."""
        c, r = self.captured, self.replicator
        return {
            "state_bytes": c.layout.state_bytes if c is not None else 0,
            "held_bytes": r.held_bytes() if r is not None else self.own.nbytes if self.own is not None else 0,
            "snapshots": r.completed if r is not None else 0,
            "chain_us": r.last_chain_us if r is not None else 0,
        }
