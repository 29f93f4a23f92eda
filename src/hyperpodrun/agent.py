"""The per-node agent: rendezvous, start the local ranks, watch them, restart or finish.

States (``AgentState``) and transitions::

    INIT -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                 ^           |--(rank failed, restarts left)--> RENDEZVOUS
                 |           |--(rank failed, none left)------> FAILED
                 |           |--(signal)----------------------> STOPPED
                 '-----------'--(membership change: scale)----> RENDEZVOUS   (elastic only)

One loop serves static and elastic jobs: the :class:`RendezvousHandler` decides, the agent
carries out its :class:`Directive` (stop now, save and exit at a step, exit).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from enum import Enum

from elastic_events.control import ControlWriter, RankPhase, RankProgress
from hyperpodrun.agent_dir import AgentDir
from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import RendezvousClosedError, RendezvousError, SignalReceived, WorkerFailedError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.hang import HangPolicy, HangReport, dump_stacks, hung_ranks
from hyperpodrun.held import held_line
from hyperpodrun.logs import LogDirectory
from hyperpodrun.monitor import Answer, EventEnd, InFlight, answer, event_end, local_status
from hyperpodrun.netif import choose_gloo_interface
from hyperpodrun.outage import StoreOutage, poll_riding_out_outages
from hyperpodrun.progress import LateRanks, StepRates
from hyperpodrun.publishing import publish, write_event
from hyperpodrun.rank_start import RankStarter
from hyperpodrun.reaper import Reaper
from hyperpodrun.rendezvous import Directive, DirectiveKind, LocalStatus, RendezvousHandler, RestartReason, RoundInfo
from hyperpodrun.repair import InPlaceRepair, poll_interval, stuck_in_broken_group
from hyperpodrun.signals import SignalLatch, Wakeup
from hyperpodrun.sigterm import InterruptibleWaits, LeaveRequested, requested_by_ranks
from hyperpodrun.store import EmbeddedStoreGoneError, StoreError
from hyperpodrun.supervisor import (
    WorkerGroup,
    WorkerState,
    become_subreaper,
    restore_subreaper,
)

log = logging.getLogger(__name__)


class AgentState(str, Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class Agent:
    """Supervises the local ranks of one node through rounds of the rendezvous."""

    #: Called with the ranks' steps and seconds per step at each poll (metrics, issue 13); None: nobody listens.
    on_progress: Callable[[tuple[int, ...], tuple[float, ...]], None] | None = None

    def __init__(
        self,
        config: LaunchConfig,
        rendezvous: RendezvousHandler,
        *,
        run_id: str,
        events: EventLog,
        logs: LogDirectory,
        rdzv_timeout: float,
        control: ControlWriter,
        ranks: RankStarter,
        repair: InPlaceRepair,
        workdir: AgentDir | None = None,
        same_job: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        wakeup: Wakeup | None = None,
    ) -> None:
        """Built by :func:`hyperpodrun.launch.create_agent` from a config; unit tests pass fakes.

        ``control``: the node's control channel; ``ranks``: starts the ranks (and the reaper that stops
        them if the agent dies is given to it by :meth:`run`); ``repair``: replaces failed ranks in place;
        ``workdir``: the node-local folder of ``control`` (closed with the agent); ``same_job``: pids of
        other launchers of this job on this host; ``clock``: the host's monotonic clock, the one ranks
        stamp their progress with; ``wakeup``: the monitor's wait between ticks, which signals cut short.
        """
        self.config = config
        self.rdzv = rendezvous
        self.run_id = run_id
        self.events = events
        self.rdzv_timeout = rdzv_timeout
        self.state = AgentState.INIT
        self._logs = logs
        self._dir = workdir
        self._same_job = same_job
        self._control = control
        self._ranks = ranks
        self._repair = repair
        self._clock = clock
        self._group: WorkerGroup | None = None
        self._reaper: Reaper | None = None
        self._signal: int | None = None
        self._wake = wakeup if wakeup is not None else Wakeup()  # set by the signal handler: no lock (signals.py)
        # in an elastic job a SIGTERM is a graceful leave: it ends only the rendezvous' waits (LeaveRequested)
        self._signals = SignalLatch(self.handle_signal, interrupts=lambda signum: not self._leaves_on(signum))
        self._outage = StoreOutage(limit=config.rdzv_settings.outage_timeout, clock=clock)
        self._parked: WorkerGroup | None = None  # a standby's pre-warmed ranks
        self._flight = InFlight.idle()  # the running group's event in flight (hyperpodrun.monitor)
        self._hang_policy = HangPolicy(timeout=config.hang_timeout)
        self._waits: InterruptibleWaits | None = None  # the rendezvous store, its waits ended by SIGTERM

    @property
    def restart_count(self) -> int:
        """Failure restarts the job used so far (TORCHELASTIC_RESTART_COUNT of the ranks it starts)."""
        return self._ranks.restart_count

    @property
    def in_flight(self) -> InFlight:
        """What the monitor has in flight for the running group (:mod:`hyperpodrun.monitor`)."""
        return self._flight

    # -- public ------------------------------------------------------------------------

    def run(self) -> None:
        """Run the job to completion; raises WorkerFailedError or SignalReceived otherwise."""
        was_subreaper = become_subreaper()
        self._reaper = self._ranks.reaper = Reaper()
        self._signals.install(self.config.signals_to_handle)
        self.events.emit(EventType.AGENT_STARTED, pid=os.getpid(), log_dir=str(self._logs.run_dir))
        if self._same_job:
            _say(
                f"warning: another launcher of job {self.run_id} runs on this host (pid "
                f"{', '.join(map(str, self._same_job))}): the ranks of both get LOCAL_RANK 0 upward (the same devices)"
            )
        try:
            self._ranks.start_forkserver()
            self.run_rounds()
        finally:
            self.stop_ranks()
            self._signals.restore()
            self._wake.close()
            self._ranks.stop_forkserver()
            if self._reaper is not None:
                self._reaper.close()
            self._control.close()
            if self._dir is not None:
                self._dir.close()
            restore_subreaper(was_subreaper)
            self.rdzv.shutdown(succeeded=self.state == AgentState.SUCCEEDED)
            self.events.emit(EventType.AGENT_STOPPED, state=self.state.value)

    def stop_ranks(self) -> None:
        """Stop the ranks still running (the round's and a standby's parked ones)."""
        for group in (self._group, self._parked):
            if group is not None and group.state == WorkerState.HEALTHY:
                group.stop(grace=self.config.shutdown_timeout)

    def handle_signal(self, signum: int) -> None:
        """Note a termination signal (the handler :meth:`run` installs): the monitor acts on it at its next tick;
        in an elastic job a SIGTERM received while waiting in a rendezvous makes the node leave at once."""
        self._signal = signum
        self._wake.set()
        if self._waits is not None and self._waits.waiting and self._leave_pending():
            raise LeaveRequested  # out of a rendezvous wait (it changes nothing): the node leaves now

    # -- main loop ---------------------------------------------------------------------

    def run_rounds(self) -> None:
        """Rounds of the job: rendezvous, run the ranks, follow the round's directive. :meth:`run` without its
        process-wide setup (subreaper, reaper, signal handlers) and teardown: what unit tests drive."""
        rdzv = self.rdzv
        if rdzv.elastic and hasattr(rdzv, "store"):  # a SIGTERM ends a rendezvous wait at once (sigterm.py)
            self._waits = rdzv.store = InterruptibleWaits(rdzv.store, pending=self._leave_pending)
        try:
            with self._signals.interruptible(self._signal):
                self._guard_store(rdzv.join)
        except LeaveRequested:  # a SIGTERM before this node was part of anything: nothing to hand on
            self._finish_closed("SIGTERM before joining", succeeded=True, left=True)
            return
        if rdzv.local_addr is not None:
            gloo = choose_gloo_interface(rdzv.local_addr, os.environ)
            self._ranks.net_env = dict(gloo.env)
            if gloo.message:
                _say(gloo.message)
        while True:
            self.state = AgentState.RENDEZVOUS
            try:
                # Ctrl-C ends the wait for other nodes at once (SignalReceived); in an elastic job a SIGTERM is a
                # graceful leave instead: its wait ends (LeaveRequested) and the node asks to leave
                with self._signals.interruptible(self._signal):
                    rnd = self._guard_store(lambda: rdzv.next_round(timeout=self.rdzv_timeout, prewarm=self._prewarm))
            except LeaveRequested:
                self._signal = None
                _say("SIGTERM: leaving the job")
                self._guard_store(rdzv.request_leave)
                continue
            except RendezvousClosedError as e:
                self._finish_closed(str(e), succeeded=e.status != "failed", left=e.status == "left")
                return
            self._ranks.restart_count = rnd.restarts
            self.events.round, self.events.world_size = rnd.round, rnd.assignment.world_size
            self.events.emit(EventType.RENDEZVOUS_DONE, members=list(rnd.members), reason=rnd.reason.value)
            if rdzv.elastic:
                _say(
                    f"round {rnd.round}: {len(rnd.members)} node(s), world size {rnd.assignment.world_size}, "
                    f"this node is group rank {rnd.assignment.group_rank} ({rnd.reason.value})"
                )
            directive = self._run_round(rnd)
            if directive.kind == DirectiveKind.EXIT:
                if not rdzv.elastic:  # an elastic job's outcome is logged once, by its decider
                    self.events.emit(
                        EventType.JOB_SUCCEEDED if directive.exit_code == 0 else EventType.JOB_FAILED,
                        reason=directive.reason,
                    )
                self._finish_closed(directive.reason, succeeded=directive.exit_code == 0)
                return

    def _run_round(self, rnd: RoundInfo) -> Directive:
        """Run this node's ranks in ``rnd`` and in every round they move into in place; the directive that
        ended the last one for this node."""
        if rnd.admission is not None:  # admitted in place: the (pre-warmed) ranks join the running job
            group = self._admit(rnd, rnd.admission)
        else:
            self._drop_parked()
            group = self._start_group(rnd, rnd.reason)
        self.state = AgentState.RUNNING
        while True:
            directive, in_place = self._monitor(group)
            if not in_place:
                return directive
            if rnd.admission is None or directive.event_id != rnd.admission.event_id:
                rnd = self.rdzv.entered_in_place(directive)  # a member's ranks moved rounds in place
            group.assignment = rnd.assignment
            self.events.round, self.events.world_size = rnd.round, rnd.assignment.world_size
            self.events.emit(
                EventType.RENDEZVOUS_DONE, members=list(rnd.members), reason=rnd.reason.value, in_place=True
            )
            _say(
                f"round {rnd.round}: ranks reconfigured in place, world size {rnd.assignment.world_size}, "
                f"this node is group rank {rnd.assignment.group_rank}"
            )
            if directive.hold:
                _say(held_line(rnd.round, self.config.min_nodes))

    def _monitor(self, group: WorkerGroup) -> tuple[Directive, bool]:
        """Watch the ranks and the rendezvous until the round ends for this node or its ranks move rounds.

        Returns the directive that ended it and whether the ranks moved to the next round in place
        (RECONFIGURE: every local rank reports READY in it). The state is ``self._flight``, whose
        transitions :mod:`hyperpodrun.monitor` documents and decides; this loop carries them out.
        """
        rdzv = self.rdzv
        next_poll = 0.0
        rates = StepRates(self.config.nproc_per_node)
        while True:
            self._note_finished(group)
            state = group.poll()
            if state == WorkerState.FAILED and self._flight.acts_on_failure:
                state, next_poll = self._on_failed_rank(group), 0.0  # reported in this tick: see _check_hang
            self._take_signals(group)
            if rdzv.lease_lost:
                self._rejoin(group)
            now = self._clock()
            if now >= next_poll or state != WorkerState.HEALTHY:
                progress = self._control.progress()
                steps, step_times = rates.update(progress)
                if self.on_progress is not None:  # metrics
                    self.on_progress(steps, step_times)
                failures = group.failures() if state == WorkerState.FAILED else []
                status = local_status(
                    self._flight,
                    state=state,
                    progress=progress,
                    steps=steps,
                    step_times=step_times,
                    failure=failures[0].summary() if failures else None,
                    finished=bool(group.finished),
                )
                in_flight = self._flight.event is not None
                next_poll = now + poll_interval(
                    repairing=status.repairing, peer_failed=status.peer_failed, pending=in_flight, tick=rdzv.tick
                )
                directive = self._poll(status, group, pending=in_flight)
                what = answer(self._flight, directive) if directive is not None else Answer.IGNORE
                if directive is not None and what is Answer.STOP_NOW:
                    return self._stop_now(group, directive), False
                if directive is not None and what is Answer.PUBLISH:
                    late = LateRanks.after_publish(
                        directive.event_id,
                        publish(self._control, self.events, directive),
                        now=now,
                        slowest_step_s=rates.slowest,
                    )
                    self._flight = self._flight.publish(directive, now=now, graceful=rdzv.graceful_timeout, late=late)
                    continue
                if (stopped := self._check_late(group, progress, now)) is not None:
                    return stopped, False
                if self._flight.watches_broken_group(state):
                    self._release_broken_group(group, progress, now, slowest_step_s=rates.slowest)
            if self._flight.watches_hang(state):
                self._check_hang(group, rates)
                self._repair.keep_spare(
                    group, repairing=self._flight.replaced is not None, in_place=self._repairs_in_place
                )
            event = self._flight.event
            if event is not None:
                end = event_end(self._flight, now=now, state=state, progress=self._control.progress())
                if end is not None:
                    return self._end_event(group, event, end, state)
            self._wake.wait(min(self.config.monitor_interval, max(0.0, next_poll - self._clock())))

    def _on_failed_rank(self, group: WorkerGroup) -> WorkerState:
        """A local rank failed: replaced in place, or its siblings stopped (they must not hang in a collective)."""
        if self._repairs_in_place():
            state, what = self._repair.replace_failed(group, cause=self._flight.killed or self._flight.hung)
            self._flight = self._flight.replace_failed(what)
            return state
        self._flight = self._flight.stop_failed()
        self._log_failure(group)
        return WorkerState.FAILED

    def _take_signals(self, group: WorkerGroup) -> None:
        """Act on a termination signal: in an elastic job a SIGTERM (the agent's or a local rank's) asks to leave
        the job at the next agreed step; any other signal stops the ranks and ends the agent."""
        rdzv = self.rdzv
        if self._signal is None and not rdzv.leaving and requested_by_ranks(self._control):
            self._signal = signal.SIGTERM  # a local rank received SIGTERM: the same request as the agent's own
        if self._signal is None:
            return
        if self._signal == signal.SIGTERM and rdzv.elastic:
            self._signal = None
            self._wake.clear()
            _say("SIGTERM: leaving the job at the next agreed step")
            self._guard_store(rdzv.request_leave, group)
        else:
            self._on_signal(group, self._signal)

    def _check_late(self, group: WorkerGroup, progress: list[RankProgress], now: float) -> Directive | None:
        """Once the late ranks of the published event acted or their grace is over: a STOP when some never
        acted (a rank acted at the target in time, so the late one waits in a collective for it)."""
        late, event = self._flight.late, self._flight.event
        if late is None or event is None or (stuck := late.stuck(progress, now)) is None:
            return None
        self._flight = self._flight.late_settled()
        if not stuck:
            return None
        self._control.clear()
        reason = f"{event.reason}; local rank(s) {stuck} had passed step {event.target_step} when it was published"
        return self._stop_now(group, dataclasses.replace(event, kind=DirectiveKind.STOP, reason=reason))

    def _release_broken_group(
        self, group: WorkerGroup, progress: list[RankProgress], now: float, *, slowest_step_s: float
    ) -> None:
        """Kill the local ranks still blocked in the broken group a while after its repair was published:
        they are replaced in the same repair."""
        event = self._flight.event
        if event is None:
            return
        waited = now - self._flight.published
        stuck = stuck_in_broken_group(
            progress, next_round=event.next_round, waited=waited, slowest_step_s=slowest_step_s
        )
        if not stuck:
            return
        why = f"local rank(s) {stuck} still blocked in the broken group {waited:.1f}s after the repair was published"
        _say(f"{why}; their Python stacks go to their logs, then they are killed and replaced in the same repair")
        dump_stacks([group.pids[r] for r in stuck], wait=self._wake.wait)
        self._repair.kill_culprits(group, stuck)
        self._flight = self._flight.culprits_killed(why)

    def _end_event(
        self, group: WorkerGroup, event: Directive, end: EventEnd, state: WorkerState
    ) -> tuple[Directive, bool]:
        """The event in flight ended for this node (:func:`~hyperpodrun.monitor.event_end`)."""
        if end is EventEnd.MOVED:
            self._control.clear()
            self._flight = self._flight.moved()
            self.events.emit(
                EventType.WORKERS_RECONFIGURED,
                event_id=event.event_id,
                round=event.next_round,
                world_size=event.world_size,
            )
            self._guard_store(lambda: self.rdzv.report_stopped(event.event_id, ok=True, reconfigured=True), group)
            return event, True
        if end is EventEnd.FELL_BACK:
            _say(
                f"event {event.event_id}: a local rank could not move to round {event.next_round} in place; "
                "falling back to a restart"
            )
            return self._ranks_left(group, event, WorkerState.FAILED, timed_out=False), False
        return self._ranks_left(group, event, state, timed_out=end is EventEnd.TIMED_OUT), False

    def _rejoin(self, group: WorkerGroup) -> None:
        """The membership lease expired (the store was unreachable for a lease ttl): register again as the
        same node while the ranks keep training; if the job moved on without this node, the next poll says so."""
        try:
            self.rdzv.rejoin()
        except EmbeddedStoreGoneError:
            self._guard_store(self.rdzv.rejoin, group)  # the job's store is gone for good
        except StoreError:
            return  # still unreachable: try again at the next tick
        _say("this node's membership lease had expired while the store was unreachable; joined again as the same node")

    def _poll(self, status: LocalStatus, group: WorkerGroup, *, pending: bool) -> Directive | None:
        """``poll()``, riding out an unreachable store for a while (:mod:`hyperpodrun.outage`)."""
        try:
            return poll_riding_out_outages(
                self.rdzv,
                status,
                self._outage,
                pending=pending,
                events=self.events,
                acked_events=lambda: [p.acked_event for p in self._control.progress()],
            )
        except EmbeddedStoreGoneError:
            return self._guard_store(lambda: self.rdzv.poll(status), group)  # the job's store is gone for good

    def _check_hang(self, group: WorkerGroup, rates: StepRates) -> None:
        """A rank without progress for the hang limit: dump every local rank's stacks, report the failure (before any
        kill: the peers report the kill at once, and a node silent meanwhile looks lost), then fail the group."""
        limit = self._hang_policy.limit(rates.slowest)
        if limit is None:  # hang detection is off
            return
        progress = self._control.progress()
        now = self._clock()
        if not (hung := hung_ranks(progress, now=now, limit=limit)):
            return
        pids, in_place = group.pids, self._repairs_in_place()  # read once a rank is hung: it may read the store
        if in_place:  # the culprits only: the ranks waiting for them hold the state
            hung = self._repair.culprits(group, hung, progress, now=now, limit=limit)
        if not hung:
            return
        r = hung[0]
        rank, log_file = group.assignment.global_rank(r), str(group.log_file(r))
        report = HangReport.of(progress, hung, now=now, limit=limit, rank=rank, pid=pids.get(r), log_file=log_file)
        self.events.emit(EventType.RANK_HUNG, **report.record)
        _say(why := report.line)
        dump_stacks(list(pids.values()), wait=self._wake.wait)
        self._guard_store(lambda: self.rdzv.report_failure(why, repairable=in_place), group)
        if in_place:  # the kill shows as a failed rank: repaired like a crash
            self._repair.kill_culprits(group, hung)
            self._flight = self._flight.culprits_killed(why)
            return
        self._flight = self._flight.declared_hung(why)
        group.stop(grace=self.config.shutdown_timeout)

    def _note_finished(self, group: WorkerGroup) -> None:
        """Local ranks whose training finished: their exit is success whatever its code (a crash at interpreter
        exit is said once, as a warning), no event is acted on for them, and no joiner is admitted after it."""
        for r, p in enumerate(self._control.progress()):
            if p.phase == RankPhase.FINISHED and r not in group.finished:
                group.finished.add(r)
        for f in group.newly_forgiven():
            _say(f"warning: {f.summary()} after its training finished; counted as success")

    def _repairs_in_place(self) -> bool:
        """Whether a failed rank is replaced in place rather than the job restarted: the decider's rule, which
        the rendezvous applies to this node's round."""
        return self.rdzv.repairs_in_place

    def _prewarm(self) -> bool:
        """A standby of an in-process job: start the ranks parked (imported, model built, waiting for
        admission) once; whether every one of them is parked now."""
        if self._parked is None:
            self._parked = self._start_group(None, RestartReason.SCALE)
            _say("standby: ranks started parked; admission will cost group init and hydration only")
        if self._parked.poll() != WorkerState.HEALTHY:
            return False
        return all(p.phase == RankPhase.PARKED for p in self._control.progress())

    def _admit(self, rnd: RoundInfo, admission: Directive) -> WorkerGroup:
        """Publish the round's admitting event ``admission`` to the parked ranks (started now when not pre-warmed)."""
        group = self._parked if self._parked is not None and self._parked.poll() == WorkerState.HEALTHY else None
        if group is None:
            self._drop_parked()
            group = self._start_group(None, RestartReason.SCALE)
        self._parked = None
        group.assignment = rnd.assignment
        write_event(self._control, admission)
        self._flight = InFlight.admitting(admission, now=self._clock(), graceful=self.rdzv.graceful_timeout)
        self.events.emit(
            EventType.WORKERS_SIGNALLED, event_id=admission.event_id, kind="admit", target_step=admission.target_step
        )
        return group

    def _drop_parked(self) -> None:
        if self._parked is not None:
            self._parked.stop(grace=self.config.shutdown_timeout)
            self._parked = None

    def _stop_now(self, group: WorkerGroup, directive: Directive) -> Directive:
        """STOP or EXIT: stop the ranks at once and tell the rendezvous."""
        if directive.kind == DirectiveKind.STOP:
            what = _value(directive.event_kind) or "stop"
            _say(f"{what}: {directive.reason}; stopping the ranks" if self.rdzv.elastic else directive.reason)
        self.events.emit(
            EventType.WORKERS_SIGNALLED,
            event_id=directive.event_id,
            kind=directive.kind.value,
            event_kind=_value(directive.event_kind),
            reason=directive.reason,
        )
        group.stop(grace=self.config.shutdown_timeout)
        self.events.emit(EventType.WORKERS_STOPPED, event_id=directive.event_id)
        if directive.kind == DirectiveKind.STOP:
            self._guard_store(lambda: self.rdzv.report_stopped(directive.event_id, ok=False))
        self._control.clear()
        return directive

    def _ranks_left(self, group: WorkerGroup, pending: Directive, state: WorkerState, *, timed_out: bool) -> Directive:
        """The ranks of a cooperative event have exited (or not, within the graceful timeout)."""
        if timed_out:
            _say(
                f"ranks did not exit within the graceful shutdown timeout ({self.rdzv.graceful_timeout:g}s); killing them"
            )
        group.stop(grace=self.config.shutdown_timeout)
        ok = state == WorkerState.SUCCEEDED
        self.events.emit(EventType.WORKERS_STOPPED, event_id=pending.event_id, ok=ok)
        self._control.clear()
        self._guard_store(lambda: self.rdzv.report_stopped(pending.event_id, ok=ok))
        return pending

    def _log_failure(self, group: WorkerGroup) -> None:
        failures = group.failures()
        group.stop(grace=self.config.shutdown_timeout)
        failures = failures or group.failures()
        if not failures:
            return
        self.events.emit(EventType.WORKER_FAILED, **failures[0].record())

    def _guard_store(self, fn, group: WorkerGroup | None = None):
        """Run a store operation; a lost store stops the ranks and ends the agent with its message."""
        try:
            return fn()
        except StoreError as e:
            if group is not None:
                group.stop(grace=self.config.shutdown_timeout)
            self.events.emit(EventType.STORE_LOST, message=str(e))
            raise RendezvousError(f"lost the rendezvous store: {e}") from None

    def _finish_closed(self, message: str, *, succeeded: bool, left: bool = False) -> None:
        if not succeeded:
            self.state = AgentState.FAILED
            raise WorkerFailedError(message)
        self.state = AgentState.SUCCEEDED
        if left:
            print("hyperpodrun: left the job gracefully", file=sys.stderr, flush=True)

    def _start_group(self, rnd: RoundInfo | None, reason: RestartReason) -> WorkerGroup:
        """Start the local ranks for ``rnd``; ``None``: parked (no rank, world or master until admitted)."""
        group, attempt_dir = self._ranks.start(rnd, reason)
        if rnd is not None:
            self._group, self._flight = group, InFlight.idle()
        self.events.emit(
            EventType.WORKERS_STARTED,
            reason=reason.value,
            restart_count=self.restart_count,
            pids=group.pids,
            log_dir=str(attempt_dir),
        )
        return group

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, group: WorkerGroup, signum: int) -> None:
        self.state = AgentState.STOPPED
        print(
            f"hyperpodrun: received {signal.Signals(signum).name}, stopping workers "
            f"(grace {self.config.shutdown_timeout:g}s)",
            file=sys.stderr,
            flush=True,
        )
        group.stop(grace=self.config.shutdown_timeout, sig=signum)
        raise SignalReceived(signum)

    def _leaves_on(self, signum: int) -> bool:
        """Whether ``signum`` asks this node to leave the job gracefully (SIGTERM in an elastic job)."""
        return signum == signal.SIGTERM and self.rdzv.elastic

    def _leave_pending(self) -> bool:
        """A SIGTERM the agent has not acted on while it waits in a rendezvous: the node leaves the job."""
        return self._signal == signal.SIGTERM and self.state is AgentState.RENDEZVOUS and self.rdzv.elastic


def _value(enum_or_none) -> str | None:
    return enum_or_none.value if enum_or_none is not None else None


def _say(message: str) -> None:
    print(f"hyperpodrun: {message}", file=sys.stderr, flush=True)
