"""The agent driven step by step with fakes: no process, no store, no sleep.

An :class:`~hyperpodrun.agent.Agent` is built with a scripted rendezvous, a fake worker group
(and the rank starter that makes it), a fake clock and a wake-up whose every wait is one step of
the test's script. The ranks are played through the real control channel (a file in the test's
folder, written with :class:`~elastic_events.control.ControlReader` as ranks write it); the
in-place repair is the real :class:`~hyperpodrun.repair.InPlaceRepair`. Each script is a generator:
the agent runs one monitor tick, then the script runs up to its next ``yield``, and so on.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import pytest

from elastic_events.contract import GroupAssignment, RestartReason
from elastic_events.control import CAP_RECONFIGURE, ControlReader, ControlWriter, RankPhase, RankProgress
from hyperpodrun import agent as agent_module
from hyperpodrun import hang
from hyperpodrun.agent import Agent, AgentState
from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import RendezvousClosedError
from hyperpodrun.events import EventLog
from hyperpodrun.logs import LogDirectory
from hyperpodrun.monitor import MonitorPhase
from hyperpodrun.rendezvous import Directive, DirectiveKind, LocalStatus, RendezvousHandler, RoundInfo
from hyperpodrun.rendezvous.records import EventKind
from hyperpodrun.repair import InPlaceRepair
from hyperpodrun.supervisor import WorkerFailure, WorkerState

NPROC = 2
TICK = 0.25  # the rendezvous' poll interval and the monitor's: every wait is one poll

Script = Generator[None, None, None]


# -- fakes ---------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class ScriptedWakeup:
    """The monitor's wait between ticks: advances the clock by the wait and runs the script's next step."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.script: Script | None = None
        self.waits = 0

    def wait(self, timeout: float) -> bool:
        self.clock.now += timeout
        self.waits += 1
        if self.script is None or next(self.script, StopIteration) is StopIteration:
            pytest.fail(f"the agent still runs after its script ended ({self.waits} waits)")
        return False

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


class FakeGroup:
    """A worker group whose ranks are table entries: the script makes them exit or fail."""

    def __init__(self, assignment: GroupAssignment, first_pid: int) -> None:
        self.assignment = assignment
        self.pids = {r: first_pid + r for r in range(NPROC)}
        self.exitcodes: dict[int, int | None] = dict.fromkeys(range(NPROC))
        self.state = WorkerState.HEALTHY
        self.finished: set[int] = set()
        self.stopped = False
        self.replaced: dict[int, int] = {}  # local rank -> the new pid
        self.spare_running, self.spare_pid = False, None

    def poll(self) -> WorkerState:
        codes = self.exitcodes.values()
        if self.stopped:
            self.state = WorkerState.STOPPED
        elif any(c not in (None, 0) for c in codes):
            self.state = WorkerState.FAILED
        elif all(c == 0 for c in codes):
            self.state = WorkerState.SUCCEEDED
        else:
            self.state = WorkerState.HEALTHY
        return self.state

    def failures(self) -> list[WorkerFailure]:
        return [
            WorkerFailure(
                local_rank=r,
                global_rank=self.assignment.global_rank(r),
                pid=self.pids[r],
                exitcode=code,
                timestamp=0.0,
                log_file=Path(f"rank{r}.log"),
                error_file=Path(f"rank{r}.err"),
            )
            for r, code in self.exitcodes.items()
            if code not in (None, 0)
        ]

    def newly_forgiven(self) -> list[WorkerFailure]:
        return []

    def log_file(self, local_rank: int) -> Path:
        return Path(f"rank{local_rank}.log")

    def stop(self, *, grace: float, sig: int = signal.SIGTERM) -> None:
        self.stopped = True
        self.poll()

    def replace(self, local_rank: int, *, rank_env: dict[str, str], logs: object) -> int:
        pid = max(self.pids.values()) + 100
        self.pids[local_rank], self.exitcodes[local_rank], self.replaced[local_rank] = pid, None, pid
        return pid


class FakeRanks:
    """The rank starter: makes fake groups; the ranks of a started group declare the in-process API and run."""

    def __init__(self, control: ControlWriter, folder: Path) -> None:
        self.control, self.folder = control, folder
        self.restart_count = 0
        self.reaper = None
        self.net_env: dict[str, str] = {}
        self.started: list[tuple[int | None, RestartReason, FakeGroup]] = []
        self.ranks: list[ControlReader] = []

    def new_attempt(self) -> Path:
        path = self.folder / f"attempt_{len(self.started)}"
        path.mkdir(exist_ok=True)
        return path

    def rank_setup(self, directory: Path, local_rank: int) -> tuple[None, dict[str, str]]:
        return None, {}

    def start(self, rnd: RoundInfo | None, reason: RestartReason) -> tuple[FakeGroup, Path]:
        assignment = rnd.assignment if rnd is not None else assign(-1, 0)
        group = FakeGroup(assignment, first_pid=100 * (len(self.started) + 1))
        self.started.append((rnd.round if rnd is not None else None, reason, group))
        self.control.reset_ranks()
        self.ranks = [ControlReader(self.control.path, r) for r in range(NPROC)]
        for rank in self.ranks:
            rank.declare(CAP_RECONFIGURE)
            rank.set_phase(RankPhase.RUNNING, round=rnd.round if rnd is not None else 0)
            rank.check()  # the first step
        return group, self.new_attempt()

    @property
    def group(self) -> FakeGroup:
        return self.started[-1][2]


class ScriptedRendezvous(RendezvousHandler):
    """Rounds handed out in order; each poll answers what the script set with :meth:`answer` (once)."""

    def __init__(self, rounds: list[RoundInfo | Exception], *, repairs_in_place: bool = False) -> None:
        self._rounds = list(rounds)
        self._answer: Directive | None = None
        self._leaving = False
        self._repairs = repairs_in_place
        self.statuses: list[LocalStatus] = []
        self.stopped: list[tuple[int, bool, bool]] = []  # report_stopped(event_id, ok, reconfigured)
        self.entered: list[int] = []  # the rounds entered in place
        self.next_in_place: RoundInfo | None = None
        self.leave_requests = 0
        self.failures: list[tuple[str, bool]] = []  # report_failure(message, repairable)

    @property
    def node_id(self) -> str:
        return "node-a"

    @property
    def elastic(self) -> bool:
        return True

    @property
    def tick(self) -> float:
        return TICK

    @property
    def leaving(self) -> bool:
        return self._leaving

    @property
    def in_process(self) -> bool:
        return self._repairs

    @property
    def repairs_in_place(self) -> bool:
        return self._repairs

    def answer(self, directive: Directive) -> None:
        self._answer = directive

    def next_round(self, *, timeout: float, prewarm: Callable[[], bool] | None = None) -> RoundInfo:
        nxt = self._rounds.pop(0)
        if isinstance(nxt, Exception):
            raise nxt
        return nxt

    def poll(self, status: LocalStatus) -> Directive | None:
        self.statuses.append(status)
        directive, self._answer = self._answer, None
        return directive

    def entered_in_place(self, directive: Directive) -> RoundInfo:
        if self.next_in_place is None:
            pytest.fail(f"the agent moved into round {directive.next_round} in place unexpectedly")
        self.entered.append(self.next_in_place.round)
        return self.next_in_place

    def report_failure(self, message: str, *, repairable: bool) -> None:
        self.failures.append((message, repairable))

    def report_stopped(self, event_id: int, *, ok: bool, reconfigured: bool = False) -> None:
        self.stopped.append((event_id, ok, reconfigured))

    def request_leave(self) -> None:
        self.leave_requests += 1
        self._leaving = True


def assign(group_rank: int, group_world_size: int) -> GroupAssignment:
    return GroupAssignment(
        group_rank=group_rank,
        group_world_size=group_world_size,
        nproc_per_node=NPROC,
        master_addr="10.0.0.1",
        master_port=29500,
    )


def round_info(number: int, members: tuple[str, ...], *, reason: RestartReason = RestartReason.START) -> RoundInfo:
    return RoundInfo(round=number, assignment=assign(0, len(members)), members=members, reason=reason)


def reconfigure(
    event_id: int, *, next_round: int, group_world_size: int, group_rank: int = 0, kind: EventKind = EventKind.JOIN
) -> Directive:
    return Directive(
        kind=DirectiveKind.RECONFIGURE,
        event_id=event_id,
        event_kind=kind,
        target_step=4,
        next_round=next_round,
        world_size=group_world_size * NPROC,
        group_rank=group_rank,
        group_world_size=group_world_size if group_rank >= 0 else 0,
        master_addr="10.0.0.1",
        master_port=29600,
        reason=f"{kind.value} (test)",
    )


EXIT = Directive(kind=DirectiveKind.EXIT, exit_code=0, reason="all ranks exited 0")


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        rdzv: ScriptedRendezvous,
        *,
        hang_timeout: float = 0,
        repair_type: type[InPlaceRepair] = InPlaceRepair,
        monitor_interval: float = TICK,
    ) -> None:
        self.config = LaunchConfig(
            entrypoint="train",
            module=True,
            nproc_per_node=NPROC,
            monitor_interval=monitor_interval,
            hang_timeout=hang_timeout,
            spare_ranks=0,
        )
        self.rdzv = rdzv
        self.clock = FakeClock()
        self.wakeup = ScriptedWakeup(self.clock)
        self.events_path = tmp_path / "events.jsonl"
        self.events = EventLog(self.events_path, job="unit", node=rdzv.node_id)
        self.control = ControlWriter(tmp_path / "control.bin", NPROC)
        self.ranks = FakeRanks(self.control, tmp_path)
        repair = repair_type(
            self.config,
            control=self.control,
            events=self.events,
            new_attempt=self.ranks.new_attempt,
            rank_setup=self.ranks.rank_setup,  # type: ignore[arg-type]
            clock=self.clock,
        )
        self.agent = Agent(
            self.config,
            rdzv,
            run_id="unit",
            events=self.events,
            logs=LogDirectory(tmp_path / "logs", "unit"),
            rdzv_timeout=60.0,
            control=self.control,
            ranks=self.ranks,  # type: ignore[arg-type]
            repair=repair,
            clock=self.clock,
            wakeup=self.wakeup,  # type: ignore[arg-type]
        )

    def run(self, script: Callable[[Harness], Script]) -> None:
        self.wakeup.script = script(self)
        self.agent.run_rounds()

    @property
    def phase(self) -> MonitorPhase:
        return self.agent.in_flight.phase

    def records(self, event: str) -> list[dict]:
        lines = self.events_path.read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["event"] == event]

    def step_ranks(self, *, to: int) -> None:
        """Every rank steps up to step ``to`` (a rank stops at the step its event fires at)."""
        for rank in self.ranks.ranks:
            while rank.step < to and not rank.check():
                pass


# -- the monitor as pure decisions -----------------------------------------------------------


def test_an_event_is_published_only_when_nothing_is_in_flight_and_stop_or_exit_always_ends_the_round() -> None:
    from hyperpodrun.monitor import Answer, InFlight, answer

    scale = reconfigure(7, next_round=2, group_world_size=2)
    idle = InFlight.idle()
    published = idle.publish(scale, now=10.0, graceful=5.0, late=None)
    assert answer(idle, scale) is Answer.PUBLISH
    assert answer(published, reconfigure(8, next_round=3, group_world_size=3)) is Answer.IGNORE
    assert answer(published, EXIT) is Answer.STOP_NOW
    assert (published.phase, published.deadline) == (MonitorPhase.PUBLISHED, 15.0)


def test_how_an_event_ends_is_a_function_of_the_time_the_group_and_the_ranks_progress() -> None:
    from elastic_events.control import RankProgress
    from hyperpodrun.monitor import EventEnd, InFlight, event_end

    scale = reconfigure(7, next_round=2, group_world_size=2)
    flight = InFlight.idle().publish(scale, now=10.0, graceful=5.0, late=None)

    def ranks(*phases: RankPhase, round: int = 2) -> list[RankProgress]:
        return [RankProgress(step=4, time=0.0, acked_event=7, phase=p, round=round) for p in phases]

    healthy = WorkerState.HEALTHY
    ready, running = RankPhase.READY, RankPhase.RUNNING
    assert event_end(flight, now=11.0, state=healthy, progress=ranks(ready, ready)) is EventEnd.MOVED
    assert event_end(flight, now=11.0, state=healthy, progress=ranks(ready, running, round=1)) is None
    assert event_end(flight, now=11.0, state=healthy, progress=ranks(ready, RankPhase.FAILED)) is EventEnd.FELL_BACK
    assert event_end(flight, now=11.0, state=WorkerState.SUCCEEDED, progress=ranks(running)) is EventEnd.LEFT
    assert event_end(flight, now=15.5, state=healthy, progress=ranks(running, round=1)) is EventEnd.TIMED_OUT
    assert event_end(InFlight.idle(), now=99.0, state=healthy, progress=ranks(running)) is None


def test_a_failed_rank_is_acted_on_during_a_scale_event_but_not_during_a_repair_it_did_not_cause() -> None:
    from hyperpodrun.monitor import InFlight

    repair = reconfigure(9, next_round=3, group_world_size=2, kind=EventKind.RANK_FAILURE)
    assert InFlight.idle().acts_on_failure
    assert (
        InFlight.idle()
        .publish(reconfigure(7, next_round=2, group_world_size=2), now=0, graceful=1, late=None)
        .acts_on_failure
    )
    during_repair = InFlight.idle().replace_failed("rank 1 exited").publish(repair, now=0, graceful=1, late=None)
    assert not during_repair.acts_on_failure
    assert during_repair.culprits_killed("blocked in the broken group").acts_on_failure  # the rank it killed
    assert not InFlight.idle().stop_failed().acts_on_failure  # once: its siblings are stopped already
    assert during_repair.moved().phase is MonitorPhase.IDLE


# -- the agent, step by step --------------------------------------------------------------------


def test_a_join_in_place_moves_the_ranks_into_the_next_round_without_a_restart(tmp_path: Path) -> None:
    rdzv = ScriptedRendezvous([round_info(1, ("node-a",))])
    h = Harness(tmp_path, rdzv)
    rdzv.next_in_place = round_info(2, ("node-a", "node-b"), reason=RestartReason.SCALE)
    join = reconfigure(7, next_round=2, group_world_size=2)

    def script(h: Harness) -> Script:
        assert h.phase is MonitorPhase.IDLE and rdzv.statuses[-1].reconfigurable
        rdzv.answer(join)
        yield
        assert h.phase is MonitorPhase.PUBLISHED
        event = h.control.event()
        assert event is not None and (event.event_id, event.target_step, event.round, event.world_size) == (7, 4, 2, 4)
        h.step_ranks(to=4)  # the ranks act at the target step, then form round 2's group
        for rank in h.ranks.ranks:
            rank.set_phase(RankPhase.READY, round=2)
        yield
        assert rdzv.stopped == [(7, True, True)] and rdzv.entered == [2]
        assert h.phase is MonitorPhase.IDLE and h.control.event() is None
        assert h.ranks.group.assignment.world_size == 4 and h.agent.events.round == 2
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert h.agent.state is AgentState.SUCCEEDED
    assert [(rnd, reason) for rnd, reason, _ in h.ranks.started] == [(1, RestartReason.START)]  # started once
    assert [r["round"] for r in h.records("rendezvous_done")] == [1, 2]
    assert h.records("workers_reconfigured")[0]["world_size"] == 4


@pytest.mark.parametrize("exitcode", [0, 1], ids=["clean_exit", "crash_at_exit"])
def test_a_sigterm_asks_to_leave_and_the_node_exits_once_its_ranks_left(tmp_path: Path, exitcode: int) -> None:
    """A leaving node's ranks exit after they left the round; one that crashes on its way out (an error in the
    script's last lines, an abort at interpreter exit) is not replaced: nothing would run it."""
    closed = RendezvousClosedError("left the job gracefully", status="left")
    rdzv = ScriptedRendezvous([round_info(1, ("node-a", "node-b")), closed], repairs_in_place=True)
    h = Harness(tmp_path, rdzv)
    leave = reconfigure(5, next_round=2, group_world_size=1, group_rank=-1, kind=EventKind.LEAVE)

    def script(h: Harness) -> Script:
        h.agent.handle_signal(signal.SIGTERM)  # what the installed handler does
        yield
        assert rdzv.leave_requests == 1 and h.agent.state is AgentState.RUNNING  # the ranks train on
        rdzv.answer(leave)
        yield
        assert h.phase is MonitorPhase.PUBLISHED
        event = h.control.event()
        assert event is not None and event.leaves
        h.step_ranks(to=4)
        h.ranks.group.exitcodes = dict.fromkeys(range(NPROC), exitcode)  # they leave the round and exit
        yield

    h.run(script)
    assert rdzv.stopped == [(5, exitcode == 0, False)] and rdzv.leave_requests == 1
    assert h.agent.state is AgentState.SUCCEEDED
    assert h.ranks.group.stopped and len(h.ranks.started) == 1 and h.ranks.group.replaced == {}
    assert not h.records("ranks_replaced")


def test_a_sigterm_a_rank_received_is_the_nodes_request_to_leave(tmp_path: Path) -> None:
    """Slurm signals every process of a step: the rank's mark on the control channel is the agent's SIGTERM."""
    closed = RendezvousClosedError("left the job gracefully", status="left")
    rdzv = ScriptedRendezvous([round_info(1, ("node-a", "node-b")), closed])
    h = Harness(tmp_path, rdzv)

    def script(h: Harness) -> Script:
        h.ranks.ranks[1].request_termination()
        yield
        assert rdzv.leave_requests == 1
        yield  # asked once, not at every tick
        assert rdzv.leave_requests == 1
        rdzv.answer(Directive(kind=DirectiveKind.STOP, event_id=5, reason="the decider stops this node"))
        yield

    h.run(script)
    assert rdzv.stopped == [(5, False, False)] and h.ranks.group.stopped
    assert h.agent.state is AgentState.SUCCEEDED


def test_a_failed_rank_is_replaced_in_place_and_the_repair_moves_every_rank_into_the_next_round(
    tmp_path: Path,
) -> None:
    rdzv = ScriptedRendezvous([round_info(1, ("node-a", "node-b"))], repairs_in_place=True)
    h = Harness(tmp_path, rdzv)
    rdzv.next_in_place = round_info(2, ("node-a", "node-b"), reason=RestartReason.FAILURE)
    repair = reconfigure(9, next_round=2, group_world_size=2, kind=EventKind.RANK_FAILURE)

    def script(h: Harness) -> Script:
        group = h.ranks.group
        h.step_ranks(to=3)
        group.exitcodes[1] = 1  # local rank 1 crashes; rank 0 waits in recover()
        h.ranks.ranks[0].set_phase(RankPhase.RECOVERING)
        yield
        assert h.phase is MonitorPhase.REPAIRING
        assert group.replaced == {1: 201} and group.pids == {0: 100, 1: 201} and not group.stopped
        status = rdzv.statuses[-1]
        assert status.repairing and status.group_state is WorkerState.HEALTHY
        assert status.failure is not None and status.failure.startswith(
            "rank 1 (local rank 1, pid 101) exited with code 1"
        )
        replaced = h.records("ranks_replaced")
        assert [(r["ranks"], r["pids"]) for r in replaced] == [([1], [201])]
        assert h.records("worker_failed")[0]["repaired_in_place"] is True
        rdzv.answer(repair)
        yield
        assert h.phase is MonitorPhase.PUBLISHED and h.agent.in_flight.replaced is not None
        event = h.control.event()
        assert event is not None and event.repair
        for rank in h.ranks.ranks:  # the survivor re-forms the group, the replacement is hydrated into it
            rank.set_phase(RankPhase.READY, round=2)
        yield
        assert rdzv.stopped == [(9, True, True)] and rdzv.entered == [2]
        assert h.phase is MonitorPhase.IDLE and not rdzv.statuses[-1].repairing
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert len(h.ranks.started) == 1  # no job restart: the survivor kept its process
    assert h.agent.state is AgentState.SUCCEEDED


def test_a_failed_rank_is_reported_in_the_monitor_tick_that_sees_it(tmp_path: Path) -> None:
    """The monitor ticks five times between reads of the store; a crash is reported (and its rank replaced)
    in the tick that sees it, not at the next read: the peers' agents report their broken collectives within
    URGENT_POLL_S, and a node that stays silent meanwhile may be left out of the repair as lost."""
    rdzv = ScriptedRendezvous([round_info(1, ("node-a", "node-b"))], repairs_in_place=True)
    h = Harness(tmp_path, rdzv, monitor_interval=TICK / 5)

    def script(h: Harness) -> Script:
        group = h.ranks.group
        h.step_ranks(to=3)
        yield  # one tick after a read of the store: the next one is four ticks away
        polls = len(rdzv.statuses)
        group.exitcodes[1] = 1
        yield
        assert group.replaced == {1: 201}
        assert len(rdzv.statuses) == polls + 1
        status = rdzv.statuses[-1]
        assert status.repairing and status.failure is not None and status.failure.startswith("rank 1 (local rank 1")
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert len(h.ranks.started) == 1


def test_a_hung_rank_is_reported_as_this_nodes_failure_before_it_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peers' collectives fail the moment a hung rank is killed, and their agents report that at once. Had
    this node not said first that the failure is its own, the job would read it as a node gone silent (lost,
    its agent with it) and leave it out of the repaired round while its agent is still busy with the kill."""
    rdzv = ScriptedRendezvous([round_info(1, ("node-a", "node-b"))], repairs_in_place=True)
    kills: list[tuple[tuple[int, ...], list[tuple[str, bool]]]] = []  # the ranks killed; what rdzv knew then
    dumps: list[list[int]] = []

    class StoppedRankOne(InPlaceRepair):
        """The real repair over the test's process table: local rank 1 is SIGSTOPped; a kill is recorded."""

        def culprits(
            self, group, hung: Sequence[int], progress: Sequence[RankProgress], *, now: float, limit: float
        ) -> tuple[int, ...]:
            idle = {r: now - progress[r].time for r in hung}
            return hang.culprits(hung, idle=idle, states={1: "stopped"}, limit=limit)

        def kill_culprits(self, group, hung: Sequence[int]) -> None:
            kills.append((tuple(hung), list(rdzv.failures)))
            for r in hung:
                group.exitcodes[r] = -signal.SIGKILL

    def dump_stacks(pids: list[int], *, wait: Callable[[float], object]) -> None:
        dumps.append(pids)
        wait(1.0)

    monkeypatch.setattr(agent_module, "dump_stacks", dump_stacks)  # no signal to the fake pids
    h = Harness(tmp_path, rdzv, hang_timeout=2.0, repair_type=StoppedRankOne)
    h.clock.now = time.monotonic()  # the ranks stamp their progress on the host's monotonic clock

    def script(h: Harness) -> Script:
        group = h.ranks.group
        h.step_ranks(to=3)
        for _ in range(40):  # 10 s of monitor ticks: the hang limit (2 s) and the stack dump (1 s) fit in them
            if kills:
                break
            yield
        assert kills, "the agent never killed the stopped rank"
        assert dumps == [[100, 101]]
        ((killed, told),) = kills
        assert killed == (1,)  # the stopped rank only: rank 0 waits in a collective and keeps its state
        ((message, repairable),) = told
        assert message.startswith("rank 1 (local rank 1, pid 101) made no progress for 2s at step 3") and repairable
        yield
        assert group.replaced == {1: 201} and group.pids[0] == 100 and not group.stopped
        assert rdzv.statuses[-1].repairing and len(rdzv.failures) == 1
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert len(h.ranks.started) == 1


def test_a_rank_that_fails_to_move_rounds_falls_back_to_a_restart(tmp_path: Path) -> None:
    restart = round_info(3, ("node-a", "node-b"), reason=RestartReason.FAILURE)
    rdzv = ScriptedRendezvous([round_info(1, ("node-a",)), restart])
    h = Harness(tmp_path, rdzv)
    join = reconfigure(7, next_round=2, group_world_size=2)

    def script(h: Harness) -> Script:
        rdzv.answer(join)
        yield
        h.step_ranks(to=4)
        h.ranks.ranks[0].set_phase(RankPhase.READY, round=2)
        h.ranks.ranks[1].set_phase(RankPhase.FAILED, round=2)  # its new group did not form
        yield
        assert rdzv.stopped == [(7, False, False)] and rdzv.entered == []
        assert h.ranks.started[0][2].stopped
        assert [(rnd, reason) for rnd, reason, _ in h.ranks.started] == [
            (1, RestartReason.START),
            (3, RestartReason.FAILURE),
        ]
        assert h.phase is MonitorPhase.IDLE
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert h.agent.state is AgentState.SUCCEEDED


def test_a_rank_past_the_target_that_never_acts_turns_the_event_into_a_stop(tmp_path: Path) -> None:
    """A rank that had passed the target step when the event was written acts one step late; one that has not
    acted when its grace is over waits in a collective for ranks that acted in time: the event stops."""
    restart = round_info(2, ("node-a", "node-b"), reason=RestartReason.SCALE)
    rdzv = ScriptedRendezvous([round_info(1, ("node-a",)), restart])
    h = Harness(tmp_path, rdzv)
    join = reconfigure(7, next_round=2, group_world_size=2)

    def script(h: Harness) -> Script:
        h.step_ranks(to=6)  # both ranks outran the target step 4 before it was written
        rdzv.answer(join)
        yield
        late = h.agent.in_flight.late
        assert late is not None and late.ranks == (0, 1)
        assert h.records("workers_signalled")[-1]["late_ranks"] == [0, 1]
        assert h.ranks.ranks[0].check()  # rank 0 acts one step late; rank 1 never does
        while not rdzv.stopped:  # the grace: a few of the ranks' step times, at least a second
            yield
        assert rdzv.stopped == [(7, False, False)] and h.ranks.started[0][2].stopped
        assert "local rank(s) [1] had passed step 4" in h.records("workers_signalled")[-1]["reason"]
        rdzv.answer(EXIT)
        yield

    h.run(script)
    assert [(rnd, reason) for rnd, reason, _ in h.ranks.started] == [(1, RestartReason.START), (2, RestartReason.SCALE)]
