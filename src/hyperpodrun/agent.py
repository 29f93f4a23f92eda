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

from elastic_events.control import CAP_HOLD, ControlWriter, RankPhase
from hyperpodrun.agent_dir import AgentDir
from hyperpodrun.config import LaunchConfig, RestartMode
from hyperpodrun.errors import RendezvousClosedError, RendezvousError, SignalReceived, WorkerFailedError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.hang import HangPolicy, dump_stacks, hung_ranks, progress_clock
from hyperpodrun.held import held_line
from hyperpodrun.logs import LogDirectory
from hyperpodrun.netif import choose_gloo_interface
from hyperpodrun.outage import StoreOutage, final_directive
from hyperpodrun.progress import LateRanks, StepRates
from hyperpodrun.publishing import publish, write_event
from hyperpodrun.rank_start import RankStarter
from hyperpodrun.reaper import Reaper
from hyperpodrun.rendezvous import Directive, DirectiveKind, LocalStatus, RendezvousHandler, RestartReason, RoundInfo
from hyperpodrun.repair import InPlaceRepair, poll_interval, spares_for, stuck_in_broken_group
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
    ) -> None:
        self.config = config
        self.rdzv = rendezvous
        self.run_id = run_id
        self.events = events
        self.rdzv_timeout = rdzv_timeout
        self.state = AgentState.INIT
        self.restart_count = 0
        self._logs = logs
        # Node-local, private to this agent, memory-backed where /dev/shm exists; stale ones are swept first.
        self._dir, swept = AgentDir.create(job=run_id if config.rdzv_id != "none" else None)
        self._same_job = swept.same_job  # other live agents of this job on this host
        self._control = ControlWriter(self._dir.path / "control.bin", config.nproc_per_node, spares=spares_for(config))
        self._group: WorkerGroup | None = None
        self._reaper: Reaper | None = None
        self._signal: int | None = None
        self._wake = Wakeup()  # set by the signal handler: no lock (signals.py)
        # in an elastic job a SIGTERM is a graceful leave: it ends only the rendezvous' waits (LeaveRequested)
        self._signals = SignalLatch(self._handle, interrupts=lambda signum: not self._leaves_on(signum))
        self._outage = StoreOutage(limit=config.rdzv_settings.outage_timeout)
        self._parked: WorkerGroup | None = None  # a standby's pre-warmed ranks
        self._hang: str | None = None  # why the running group was declared hung
        self._ranks = RankStarter(
            config, run_id=run_id, logs=logs, control=self._control, node_id=rendezvous.node_id, event_log=events.path
        )
        self._repair = InPlaceRepair(
            config,
            control=self._control,
            events=events,
            new_attempt=self._ranks.new_attempt,
            rank_setup=lambda directory, local_rank: self._ranks.rank_setup(
                directory, local_rank, None, RestartReason.FAILURE, restart_count=self.restart_count
            ),
        )
        self._hang_policy = HangPolicy(timeout=config.hang_timeout)
        self._waits: InterruptibleWaits | None = None  # the rendezvous store, its waits ended by SIGTERM

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
            self._loop()
        finally:
            for group in (self._group, self._parked):
                if group is not None and group.state == WorkerState.HEALTHY:
                    group.stop(grace=self.config.shutdown_timeout)
            self._signals.restore()
            self._wake.close()
            if self._reaper is not None:
                self._reaper.close()
            self._control.close()
            self._dir.close()
            restore_subreaper(was_subreaper)
            self.rdzv.shutdown(succeeded=self.state == AgentState.SUCCEEDED)
            self.events.emit(EventType.AGENT_STOPPED, state=self.state.value)

    # -- main loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        """Rounds of the job: rendezvous, run the ranks, follow the round's directive."""
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
            self.restart_count = rnd.restarts
            self.events.round, self.events.world_size = rnd.round, rnd.assignment.world_size
            self.events.emit(EventType.RENDEZVOUS_DONE, members=list(rnd.members), reason=rnd.reason.value)
            if rdzv.elastic:
                _say(
                    f"round {rnd.round}: {len(rnd.members)} node(s), world size {rnd.assignment.world_size}, "
                    f"this node is group rank {rnd.assignment.group_rank} ({rnd.reason.value})"
                )
            if rnd.admission is not None:  # admitted in place: the (pre-warmed) ranks join the running job
                group, pending = self._admit(rnd, rnd.admission), rnd.admission
            else:
                self._drop_parked()
                group, pending = self._start_group(rnd, rnd.reason), None
            self.state = AgentState.RUNNING
            while True:
                directive, in_place = self._monitor(group, pending)
                if not in_place:
                    break
                pending = None
                if rnd.admission is None or directive.event_id != rnd.admission.event_id:
                    rnd = rdzv.entered_in_place(directive)  # a member's ranks moved rounds in place
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
            if directive.kind == DirectiveKind.EXIT:
                if not rdzv.elastic:  # an elastic job's outcome is logged once, by its decider
                    self.events.emit(
                        EventType.JOB_SUCCEEDED if directive.exit_code == 0 else EventType.JOB_FAILED,
                        reason=directive.reason,
                    )
                self._finish_closed(directive.reason, succeeded=directive.exit_code == 0)
                return

    def _monitor(self, group: WorkerGroup, pending: Directive | None) -> tuple[Directive, bool]:
        """Watch the ranks and the rendezvous until the round ends for this node.

        Returns the directive that ended it and whether the ranks moved to the next round in
        place (RECONFIGURE: every local rank reports READY in it). ``pending``: an admission
        already published to parked ranks.
        """
        rdzv = self.rdzv
        deadline = time.monotonic() + rdzv.graceful_timeout
        next_poll = 0.0
        failure_logged = False
        rates = StepRates(self.config.nproc_per_node)
        late: LateRanks | None = None  # ranks that were past the published target: they must act one step late
        published = 0.0  # when the pending event was put on the control channel
        while True:
            self._note_finished(group)
            state = group.poll()
            rescued = (
                pending is not None and pending.repair and self._repair.hung_killed is not None
            )  # we killed a stuck rank
            # A scale event in place that a local rank's failure met on its way: its replacement, parked, is
            # admitted by that event, as the survivors (their collective failed) take its group at once.
            scaling = pending is not None and pending.kind == DirectiveKind.RECONFIGURE and not pending.repair
            if state == WorkerState.FAILED and (pending is None or rescued or scaling) and not failure_logged:
                if self._repairs_in_place():
                    state, self._hang = self._repair.replace_failed(group, hang=self._hang), None
                else:
                    failure_logged = True
                    self._log_failure(group)  # its siblings stop now: they must not hang in a collective
            if self._signal is None and not rdzv.leaving and requested_by_ranks(self._control):
                self._signal = signal.SIGTERM  # a local rank received SIGTERM: the same request as the agent's own
            if self._signal is not None:
                if self._signal == signal.SIGTERM and rdzv.elastic:
                    self._signal = None
                    self._wake.clear()
                    _say("SIGTERM: leaving the job at the next agreed step")
                    self._guard_store(rdzv.request_leave, group)
                else:
                    self._on_signal(group, self._signal)
            if rdzv.lease_lost:
                self._rejoin(group)
            now = time.monotonic()
            if now >= next_poll or state != WorkerState.HEALTHY:
                progress = self._control.progress()
                steps, step_times = rates.update(progress)
                if self.on_progress is not None:  # metrics
                    self.on_progress(steps, step_times)
                failures = group.failures() if state == WorkerState.FAILED else []
                status = LocalStatus(
                    group_state=WorkerState.FAILED if self._hang else state,
                    steps=steps,
                    step_times=step_times,  # a rank replaced to be repaired in place declares again once it runs
                    reconfigurable=all(p.reconfigurable for p in progress) or self._repair.repairing is not None,
                    can_hold=all(p.capabilities & CAP_HOLD for p in progress),
                    failure=self._repair.repairing or self._hang or (failures[0].summary() if failures else None),
                    repairing=self._repair.repairing is not None,
                    peer_failed=any(p.phase == RankPhase.RECOVERING for p in progress),
                    finished=bool(group.finished),
                )
                next_poll = now + poll_interval(
                    repairing=status.repairing,
                    peer_failed=status.peer_failed,
                    pending=pending is not None,
                    tick=rdzv.tick,
                )
                directive = self._poll_riding_out_outages(status, group, pending=pending is not None)
                if directive is not None and (
                    directive.kind in (DirectiveKind.EXIT, DirectiveKind.STOP) or pending is None
                ):
                    if directive.kind in (DirectiveKind.SAVE_AND_EXIT, DirectiveKind.RECONFIGURE):
                        late = LateRanks.after_publish(
                            directive.event_id,
                            publish(self._control, self.events, directive),
                            now=now,
                            slowest_step_s=rates.slowest,
                        )
                        pending, published, deadline = directive, now, now + rdzv.graceful_timeout
                        continue
                    return self._stop_now(group, directive), False
                if pending is not None and late is not None and (stuck := late.stuck(progress, now)) is not None:
                    late = None
                    if stuck:  # some rank acted at the target in time: the late one waits in a collective for it
                        self._control.clear()
                        reason = f"{pending.reason}; local rank(s) {stuck} had passed step {pending.target_step} when it was published"
                        return self._stop_now(
                            group, dataclasses.replace(pending, kind=DirectiveKind.STOP, reason=reason)
                        ), False
                if (
                    pending is not None
                    and pending.repair
                    and state == WorkerState.HEALTHY
                    and self._repair.hung_killed is None
                ):
                    stuck = stuck_in_broken_group(
                        progress, next_round=pending.next_round, waited=now - published, slowest_step_s=rates.slowest
                    )
                    if stuck:
                        why = f"local rank(s) {stuck} still blocked in the broken group {now - published:.1f}s after the repair was published"
                        _say(
                            f"{why}; their Python stacks go to their logs, then they are killed and replaced in the same repair"
                        )
                        dump_stacks([group.pids[r] for r in stuck], wait=self._wake.wait)
                        self._repair.kill_culprits(group, stuck, why)
            if (
                pending is None
                and state == WorkerState.HEALTHY
                and self._hang is None
                and self._repair.hung_killed is None
            ):
                self._check_hang(group, rates)
                self._repair.keep_spare(group, in_process=self._repairs_in_place)
            if pending is not None and state == WorkerState.HEALTHY and self._moved_in_place(pending):
                self._control.clear()
                self._repair.repairing = None
                self.events.emit(
                    EventType.WORKERS_RECONFIGURED,
                    event_id=pending.event_id,
                    round=pending.next_round,
                    world_size=pending.world_size,
                )
                self._guard_store(
                    lambda event_id=pending.event_id: rdzv.report_stopped(event_id, ok=True, reconfigured=True), group
                )
                return pending, True
            if pending is not None and pending.kind == DirectiveKind.RECONFIGURE and self._failed_in_place():
                _say(
                    f"event {pending.event_id}: a local rank could not move to round {pending.next_round} in place; falling back to a restart"
                )
                return self._ranks_left(group, pending, WorkerState.FAILED, timed_out=False), False
            if pending is not None and (state != WorkerState.HEALTHY or now > deadline):
                return self._ranks_left(group, pending, state, timed_out=state == WorkerState.HEALTHY), False
            self._wake.wait(min(self.config.monitor_interval, max(0.0, next_poll - time.monotonic())))

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

    def _poll_riding_out_outages(self, status: LocalStatus, group: WorkerGroup, *, pending: bool) -> Directive | None:
        """``poll()``; while the store is unreachable the ranks keep training (they do not need it)
        for up to ``outage_timeout``; then the job ends for this node (:mod:`hyperpodrun.outage`)."""
        try:
            directive = self.rdzv.poll(status)
        except EmbeddedStoreGoneError:
            return self._guard_store(lambda: self.rdzv.poll(status), group)  # the job's store is gone for good
        except StoreError as e:
            if self._outage.failed():
                _say(
                    f"the rendezvous store is unreachable ({e}); the ranks keep training meanwhile, "
                    f"for up to {self._outage.limit:g}s"
                )
                self.events.emit(EventType.STORE_UNREACHABLE, message=str(e))
            if not self._outage.conclude():
                return None
            acked = [p.acked_event for p in self._control.progress()]
            final = final_directive(status, pending=pending, acked_events=acked, limit=self._outage.limit, error=str(e))
            _say(final.reason)
            self.events.emit(EventType.STORE_LOST, message=final.reason)
            return final
        if (outage := self._outage.recovered()) is not None:
            _say(f"the rendezvous store is back after {outage:.1f}s")
            self.events.emit(EventType.STORE_RECOVERED, outage_s=round(outage, 3))
        return directive

    def _check_hang(self, group: WorkerGroup, rates: StepRates) -> None:
        """A rank without progress for the hang limit: dump every local rank's stacks, then fail the group."""
        limit = self._hang_policy.limit(rates.slowest)
        if limit is None:  # hang detection is off
            return
        progress = self._control.progress()
        now = progress_clock()
        hung = hung_ranks(progress, now=now, limit=limit)
        pids = group.pids
        if hung and self._repairs_in_place():  # the culprits only: the ranks waiting for them hold the state
            hung = self._repair.culprits(group, hung, progress, now=now, limit=limit)
        if not hung:
            return
        r = hung[0]
        idle = now - progress[r].time
        rank = group.assignment.global_rank(r)
        why = (
            f"rank {rank} (local rank {r}, pid {pids.get(r)}) made no progress for {idle:.0f}s at step {progress[r].step} "
            f"(hang timeout {limit:g}s); Python stacks of every local rank in their logs: {group.log_file(r)}"
        )
        self.events.emit(
            EventType.RANK_HUNG,
            rank=rank,
            local_ranks=list(hung),
            step=progress[r].step,
            idle_s=round(idle, 3),
            hang_timeout=limit,
            log_file=str(group.log_file(r)),
        )
        _say(why)
        dump_stacks(list(pids.values()), wait=self._wake.wait)
        if self._repairs_in_place():  # the kill shows as a failed rank: repaired like a crash
            self._repair.kill_culprits(group, hung, why)
            return
        self._hang = why
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
        """Whether a failed rank is replaced in place (the round runs in-process) rather than the job restarted."""
        return self.rdzv.in_process and self.config.restart_mode is RestartMode.AUTO

    def _failed_in_place(self) -> bool:
        """A local rank reported FAILED while moving rounds (its new group did not form, hydration failed)."""
        return any(p.phase == RankPhase.FAILED for p in self._control.progress())

    def _moved_in_place(self, pending: Directive) -> bool:
        """Every local rank runs in the RECONFIGURE event's round (a leaving node's ranks never do)."""
        if pending.kind != DirectiveKind.RECONFIGURE or pending.group_rank < 0:
            return False
        return all(
            p.round == pending.next_round and p.phase in (RankPhase.READY, RankPhase.RUNNING, RankPhase.HOLDING)
            for p in self._control.progress()
        )

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
        root = failures[0]
        self.events.emit(
            EventType.WORKER_FAILED,
            rank=root.global_rank,
            exitcode=root.exitcode,
            signal=root.signal_name,
            message=root.message,
            log_file=str(root.log_file),
        )

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
        group, attempt_dir = self._ranks.start(rnd, reason, restart_count=self.restart_count)
        if rnd is not None:
            self._group, self._hang = group, None
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

    def _handle(self, signum: int) -> None:
        self._signal = signum
        self._wake.set()
        if self._waits is not None and self._waits.waiting and self._leave_pending():
            raise LeaveRequested  # out of a rendezvous wait (it changes nothing): the node leaves now

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
