"""Store-backed elastic rendezvous: membership, rounds, and the scale-event protocol.

Every agent joins with a leased ``nodes/<id>`` key. One agent at a time is the
*decider*: the holder of the leased ``decider`` key (the first to take it; another
takes it within a lease ttl when its holder dies or leaves). It runs the pure policy
(:func:`hyperpodrun.policy.decide`) and drives scale events through the store;
compare-and-swap on ``round`` and ``event`` makes a change of decider safe.

Keys under the job prefix::

    nodes/<id>            leased   {"addr", "port", "leaving", "nproc"}   one per agent
    decider               leased   <id>                                    who runs the policy
    round                          {"round", "members", "master_addr", "master_port",
                                    "state": running|halted, "restarts", "events"}
    event                          {"id", "round", "kind": save|stop, "next", "reason", "target"}
    ack/<event>/<id>               {"step", "step_time", "cooperative"}   ranks' progress
    stopped/<event>/<id>           {"ok"}                                 ranks have exited
    done/<round>/<id>, failed/<round>/<id>                                outcome of a round
    closed                         {"status": succeeded|failed, "message"}
    history                        [{"ts", "round", "what", "reason"}, ...]  last 50 decisions
    ctl/cap                        {"cap": N | null}                      hyperpodctl

A cooperative scale event (``save``): the decider writes the event; each member
agent acks with its ranks' current step and step time; the decider picks a target
step ahead of the fastest rank (:func:`choose_target_step`) and writes it; agents
put it on their control channel, where every rank's ``elastic_event_detected()``
returns True at that step; ranks save and exit; agents report ``stopped``; the
decider publishes the next round. A lost node or a failed rank makes a ``stop``
event instead: ranks are stopped at once (they must not hang in a collective)
and the next round resumes from the last complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import RendezvousClosedError, RendezvousError, RendezvousTimeoutError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.policy import Action, ClusterView, Decision, ElasticPolicy, NodeState, decide
from hyperpodrun.rendezvous import RendezvousHandler, RestartReason, RoundInfo, free_port
from hyperpodrun.job_settings import check_join, job_settings
from hyperpodrun.store import LeaseKeeper, Store, StoreError, create_store
from hyperpodrun.store.base import parse_endpoint
from hyperpodrun.supervisor import GroupAssignment, WorkerState

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pure helpers


def choose_target_step(
    steps: Sequence[int], step_times: Sequence[float], *, propagation: float, max_margin: int = 10_000
) -> int:
    """The step at which every rank leaves: ahead of the fastest rank by the propagation delay.

    ``steps`` are the ranks' latest counts of ``elastic_event_detected()`` calls as acked,
    ``step_times`` their recent seconds per step (0 when unknown), ``propagation`` the
    worst-case seconds from now until every agent has written the target into its
    ranks' control channel. Synchronous data parallelism keeps ranks within a step of
    each other, so ``max(steps) + 1 + ceil(propagation / fastest step)`` (plus one step
    of slack) is reached by no rank before it has learnt the target.
    """
    if not steps:
        raise ValueError("choose_target_step needs at least one rank's step")
    known = [t for t in step_times if t > 0]
    fastest = min(known) if known else 0.0
    margin = max_margin if fastest == 0.0 else min(max_margin, math.ceil(propagation / fastest))
    return max(steps) + 2 + margin


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers use to reach us), not the FQDN."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP connect sends nothing; it only selects the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


# --------------------------------------------------------------------------- directives


class DirectiveKind(str, Enum):
    """What the agent must do with its running ranks."""

    SAVE_AND_EXIT = "save_and_exit"  # publish target_step to the ranks; they save and exit
    STOP = "stop"  # stop the ranks now (lost node, failed rank, non-cooperative script)
    EXIT = "exit"  # the job is over for this node: exit with exit_code


@dataclass(frozen=True, kw_only=True)
class Directive:
    kind: DirectiveKind
    event_id: int = 0
    target_step: int = -1
    world_size: int = -1
    reason: str = ""
    exit_code: int = 0


@dataclass(frozen=True, kw_only=True)
class LocalStatus:
    """What the agent tells the rendezvous on every tick."""

    group_state: WorkerState
    steps: tuple[int, ...]
    step_times: tuple[float, ...]
    failure: str | None = None


@dataclass(kw_only=True)
class RendezvousSettings:
    """Tunables from ``--rdzv-conf`` (all seconds); validated on construction."""

    lease_ttl: float = 10.0
    join_timeout: float = 900.0
    ack_timeout: float = 30.0
    propagation: float = 1.0  # budget for a target step to reach every rank
    tick: float = 0.2  # how often the decider re-reads the store at most
    store_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("lease_ttl", "join_timeout", "ack_timeout", "propagation", "tick", "store_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise RendezvousError(f"--rdzv-conf {name}: must be a number > 0, got {value!r}")

    @classmethod
    def from_conf(cls, conf: dict[str, str]) -> RendezvousSettings:
        kwargs: dict[str, float] = {}
        for name in ("lease_ttl", "join_timeout", "ack_timeout", "propagation", "tick", "store_timeout"):
            if name in conf:
                try:
                    kwargs[name] = float(conf[name])
                except ValueError:
                    raise RendezvousError(f"--rdzv-conf {name}: expected seconds, got {conf[name]!r}") from None
        if "timeout" in conf and "join_timeout" not in kwargs:  # torchrun's spelling
            try:
                kwargs["join_timeout"] = float(conf["timeout"])
            except ValueError:
                raise RendezvousError(f"--rdzv-conf timeout: expected seconds, got {conf['timeout']!r}") from None
        return cls(**kwargs)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _loads(raw: bytes | None) -> Any:
    return json.loads(raw) if raw else None


@dataclass
class _DeciderMemory:
    """Decider-local observations (times on this agent's clock): no cross-node clock skew."""

    first_seen: dict[str, float] = field(default_factory=dict)
    lost_since: dict[str, float] = field(default_factory=dict)
    capacity_since: float | None = None
    first_min_reached_at: float | None = None
    last_reason: str = ""


class ElasticRendezvous(RendezvousHandler):
    """One node's membership in an elastic job, over a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        *,
        policy: ElasticPolicy,
        nproc_per_node: int,
        local_addr: str,
        max_restarts: int,
        settings: RendezvousSettings,
        events: EventLog | None = None,
        max_world_size: int | None = None,
        clock: Callable[[], float] = time.time,
        node_id: str | None = None,
        on_store_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.nproc = nproc_per_node
        self.local_addr = local_addr
        self.max_restarts = max_restarts
        self.settings = settings
        self.events = events
        self.max_world_size = max_world_size
        self.clock = clock
        self._node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self._mem = _DeciderMemory()
        self._round: dict[str, Any] | None = None  # the round this node runs in
        self._handled_event = 0
        self._acked_event = 0
        self._stopped_reported = 0
        self._leaving = False
        self._keeper: LeaseKeeper | None = None
        self._lease = None
        self._on_store_lost = on_store_lost
        self._last_decide = 0.0

    # -- identity and membership -------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._node_id

    def join(self) -> None:
        self._lease = self.store.grant_lease(self.settings.lease_ttl)
        closed = self.store.get("closed")
        if closed is not None:
            status = (_loads(closed.value) or {}).get("status", "closed")
            raise RendezvousClosedError(
                f"a job with this --rdzv-id already ran and {status}; use a new --rdzv-id "
                "(or delete the old job's keys, e.g. etcdctl del --prefix /hyperpodrun/v1/<id>/)",
                status="failed",
            )
        settings = job_settings(nproc_per_node=self.nproc, policy=self.policy, max_world_size=self.max_world_size)
        check_join(self.store, self._node_id, settings, _loads)  # issue 12: refuse a node that differs
        record = {
            "addr": self.local_addr, "port": free_port(self.local_addr), "leaving": False,
            "pid": os.getpid(), "nproc": self.nproc, "settings": settings,
        }  # fmt: skip
        self.store.put(f"nodes/{self._node_id}", _dumps(record), lease=self._lease)
        self._keeper = LeaseKeeper(self._lease, on_lost=lambda e: log.warning("membership lease lost: %s", e)).start()

    @property
    def lease_lost(self) -> bool:
        return self._keeper is not None and self._keeper.lost

    def request_leave(self) -> None:
        """Graceful leave (SIGTERM): members leave at the next agreed step; standbys at once."""
        if self._leaving:
            return
        self._leaving = True
        key = f"nodes/{self._node_id}"
        entry = self.store.get(key)
        record = _loads(entry.value) if entry else {"addr": self.local_addr, "port": 0}
        record["leaving"] = True
        self.store.put(key, _dumps(record), lease=self._lease)
        if self.events:
            self.events.emit(EventType.NODE_LEAVING, node_leaving=self._node_id)

    @property
    def leaving(self) -> bool:
        return self._leaving

    def shutdown(self, *, succeeded: bool) -> None:
        try:
            if self._keeper is not None:
                self._keeper.stop()
            if self._hosts_store() and self.store.get("closed") is not None:
                # The job is over: keep the embedded store up until the other agents have read
                # that (they revoke their leases on the way out), or they would see it vanish.
                self._wait_for_others_to_leave(timeout=self.settings.lease_ttl + 5.0)
            if self._lease is not None:
                self._lease.revoke()
        except StoreError as e:
            log.info("leaving the store: %s", e)
        finally:
            self.store.close()

    def _hosts_store(self) -> bool:
        """Whether this agent's process hosts the job's (embedded) store."""
        return bool(getattr(getattr(self.store, "inner", self.store), "is_host", False))

    def _wait_for_others_to_leave(self, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rev = self.store.current_revision()
            others = [k for k in self.store.get_prefix("nodes/") if k != f"nodes/{self._node_id}"]
            remaining = deadline - time.monotonic()
            if not others:
                return
            if remaining <= 0:
                log.warning("the job is over but %d agent(s) had not left; closing the store", len(others))
                return
            self.store.wait_for_change("nodes/", after_revision=rev, timeout=remaining)

    # -- reading the store -------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        """What every node reads each tick: O(1) keys, whatever the size of the job."""
        rnd = self.store.get("round")
        ev = self.store.get("event")
        closed = self.store.get("closed")
        return {
            "round": _loads(rnd.value) if rnd else None,
            "round_rev": rnd.revision if rnd else 0,
            "event": _loads(ev.value) if ev else None,
            "event_rev": ev.revision if ev else 0,
            "closed": _loads(closed.value) if closed else None,
        }

    def _full_snapshot(self) -> dict[str, Any]:
        """What the decider reads: the snapshot plus every node record and the operator's cap."""
        nodes = {k.split("/", 1)[1]: _loads(e.value) for k, e in self.store.get_prefix("nodes/").items()}
        cap = self.store.get("ctl/cap")
        return {**self._snapshot(), "nodes": nodes, "cap": (_loads(cap.value) or {}).get("cap") if cap else None}

    def _claim_decider(self) -> bool:
        """Whether this node decides for the job: it holds the leased ``decider`` key, or takes it when free.

        The key dies with its holder's lease (crash, kill -9, graceful exit), so another
        node takes over within one lease ttl; everything a decider needs is in the store.
        """
        entry = self.store.get("decider")
        if entry is not None:
            return entry.value.decode() == self._node_id
        return self.store.compare_and_swap("decider", self._node_id.encode(), expected_revision=0, lease=self._lease)

    # -- the agent's two entry points --------------------------------------------------

    def next_round(self, *, timeout: float) -> RoundInfo:
        """Wait until this node is a member of a running round newer than the last one it ran."""
        deadline = time.monotonic() + timeout
        last = self._round["round"] if self._round else 0
        waited_msg = 0.0
        while True:
            rev = self.store.current_revision()  # before reading: a change after it wakes the wait below
            snap = self._snapshot()
            if snap["closed"]:
                closed = snap["closed"]
                raise RendezvousClosedError(closed.get("message", ""), status=closed["status"])
            if self._leaving and not self._is_member(snap):
                raise RendezvousClosedError("left the job gracefully", status="left")
            decider = self._claim_decider()
            if decider:
                self._decide(self._full_snapshot())
                snap = self._snapshot()
            rnd = snap["round"]
            if rnd and rnd["round"] > last and rnd["state"] == "running" and self._node_id in rnd["members"]:
                self._round = rnd
                return self._round_info(rnd)
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no round of the job included this node within {timeout:g}s (policy min "
                    f"{self.policy.min_replicas} node(s); a node past max or below a cap waits as a standby)"
                )
            if now - waited_msg > 10.0:
                waited_msg = now
                log.info("waiting for a round: %s", self._mem.last_reason or "waiting for nodes")
            self._wait(decider, rev)

    def poll(self, status: LocalStatus) -> Directive | None:
        """Called every monitor tick while this node's ranks run (or have just finished)."""
        snap = self._snapshot()
        ev = snap["event"]
        if snap["closed"]:
            closed = snap["closed"]
            code = 0 if closed["status"] == "succeeded" else 1
            return Directive(kind=DirectiveKind.EXIT, exit_code=code, reason=closed.get("message", ""))
        my_round = self._round["round"] if self._round else 0
        # Report this node's outcome of the round.
        if status.group_state == WorkerState.SUCCEEDED and not (ev and ev["round"] == my_round):
            self._put_once(f"done/{my_round}/{self._node_id}", {"ts": self.clock()})
        if status.group_state == WorkerState.FAILED:
            self._put_once(f"failed/{my_round}/{self._node_id}", {"message": status.failure or "rank failed"})
        # A scale event for our round?
        directive = None
        if ev and ev["round"] == my_round and ev["id"] > self._handled_event:
            directive = self._follow_event(ev, status)
        if self._claim_decider():
            self._decide(self._full_snapshot())
        return directive

    def report_stopped(self, event_id: int, *, ok: bool) -> None:
        if event_id and event_id > self._stopped_reported:
            self._stopped_reported = event_id
            self._handled_event = max(self._handled_event, event_id)
            self.store.put(f"stopped/{event_id}/{self._node_id}", _dumps({"ok": ok}))

    # -- member side of an event ---------------------------------------------------------

    def _follow_event(self, ev: dict[str, Any], status: LocalStatus) -> Directive | None:
        if ev["kind"] == "stop":
            self._handled_event = ev["id"]
            return Directive(kind=DirectiveKind.STOP, event_id=ev["id"], reason=ev["reason"])
        if self._acked_event < ev["id"]:
            self._acked_event = ev["id"]
            cooperative = any(s > 0 for s in status.steps) and status.group_state == WorkerState.HEALTHY
            self.store.put(
                f"ack/{ev['id']}/{self._node_id}",
                _dumps({"step": max(status.steps, default=0), "step_time": max(status.step_times, default=0.0), "cooperative": cooperative}),
            )
        target = ev.get("target")
        if target is None:
            return None
        self._handled_event = ev["id"]
        world = len(ev["next"]) * self.nproc if ev.get("next") else -1
        if target < 0 or any(s >= target for s in status.steps):
            # Not cooperative, or a rank is already at/past the target: stop now, resume from the last checkpoint.
            reason = ev["reason"] + ("; ranks do not call elastic_event_detected()" if target < 0 else "; a rank passed the target step")
            return Directive(kind=DirectiveKind.STOP, event_id=ev["id"], reason=reason)
        return Directive(kind=DirectiveKind.SAVE_AND_EXIT, event_id=ev["id"], target_step=target, world_size=world, reason=ev["reason"])

    # -- decider -------------------------------------------------------------------------

    def _view(self, snap: dict[str, Any], now: float) -> ClusterView:
        mem = self._mem
        nodes = snap["nodes"]
        for n in nodes:
            mem.first_seen.setdefault(n, now)
        rnd = snap["round"]
        members: tuple[str, ...] = tuple(rnd["members"]) if rnd and rnd["members"] else ()
        for m in members:
            if m in nodes:
                mem.lost_since.pop(m, None)
            else:
                mem.lost_since.setdefault(m, now)
        alive = {n: NodeState(n, mem.first_seen[n], bool(r.get("leaving"))) for n, r in nodes.items()}
        standbys = [n for n in alive if n not in members and not alive[n].leaving]
        if standbys and mem.capacity_since is None:
            mem.capacity_since = now
        elif not standbys:
            mem.capacity_since = None
        if len(alive) >= self.policy.min_replicas and mem.first_min_reached_at is None:
            mem.first_min_reached_at = now
        if rnd and rnd.get("insufficient"):
            members = ()  # the job was halted for lack of nodes: the start rules apply again
        lost = {m: t for m, t in mem.lost_since.items() if m in members}
        return ClusterView(
            round=rnd["round"] if rnd else 0,
            members=members,
            alive=alive,
            lost_since=lost,
            last_events=tuple(rnd.get("events", [])) if rnd else (),
            cap=snap["cap"],
            capacity_since=mem.capacity_since,
            first_min_reached_at=mem.first_min_reached_at,
        )

    def _decide(self, snap: dict[str, Any]) -> None:
        now = self.clock()
        ev, rnd = snap["event"], snap["round"]
        if ev and rnd and ev["round"] == rnd["round"] and not ev.get("complete"):
            self._drive_event(snap, ev, now)
            return
        if rnd and rnd["state"] == "running":
            if self._round_finished(snap):
                return
            if self._round_failed(snap):
                return
        if rnd and rnd["state"] == "halted" and rnd.get("failure") and self._after_failure(snap, now):
            return
        view = self._view(snap, now)
        decision = decide(self.policy, view, now, nproc_per_node=self.nproc, max_world_size=self.max_world_size)
        self._mem.last_reason = decision.reason
        running = bool(rnd) and rnd["state"] == "running"
        if decision.action in (Action.NONE,):
            return
        if decision.action == Action.INSUFFICIENT:
            if running:
                self._new_event(snap, kind="save", next_members=[], reason=decision.reason, action=decision.action)
            return
        if decision.action == Action.WAIT_FOR_LOST:
            if running:  # survivors would hang in a collective: stop them now
                self._new_event(snap, kind="stop", next_members=None, reason=decision.reason, action=decision.action)
            return
        if running:
            lost = any(m not in snap["nodes"] for m in rnd["members"])
            self._new_event(snap, kind="stop" if lost else "save", next_members=list(decision.members), reason=decision.reason, action=decision.action)
        else:
            reason = RestartReason.START if not rnd else (RestartReason.FAILURE if rnd.get("failed") else RestartReason.SCALE)
            self._publish_round(snap, list(decision.members), decision, reason, count_restart=False)

    def _round_finished(self, snap: dict[str, Any]) -> bool:
        rnd = snap["round"]
        done = self.store.get_prefix(f"done/{rnd['round']}/")
        finished = {k.rsplit("/", 1)[1] for k in done}
        if finished and all(m in finished for m in rnd["members"]):
            self.store.compare_and_swap("closed", _dumps({"status": "succeeded", "message": "all ranks exited 0"}), expected_revision=0)
            if self.events:
                self.events.emit(EventType.JOB_SUCCEEDED)
            return True
        return False

    def _round_failed(self, snap: dict[str, Any]) -> bool:
        """A rank failed: halt every node now; whether it counts as a restart is judged once halted."""
        rnd = snap["round"]
        failed = self.store.get_prefix(f"failed/{rnd['round']}/")
        if not failed:
            return False
        message = _loads(next(iter(failed.values())).value)["message"]
        self._new_event(snap, kind="stop", next_members=None, reason=f"rank failure: {message}", action=Action.NONE, failure=message)
        return True

    def _after_failure(self, snap: dict[str, Any], now: float) -> bool:
        """Halted after a rank failure. Wait one lease ttl: if a member vanished, the failure was
        collateral damage of a lost node (policy handles it, no restart counted); otherwise
        restart the same members, counting a restart, or close the job when none are left."""
        rnd = snap["round"]
        if any(m not in snap["nodes"] for m in rnd["members"]):
            return False  # a member is gone already: no need to wait to know
        if now < rnd["halted_at"] + self.settings.lease_ttl + self.settings.tick:
            return True
        if rnd.get("restarts", 0) >= self.max_restarts:
            suffix = f" (after {rnd['restarts']} restart{'s' * (rnd['restarts'] != 1)})" if rnd.get("restarts") else ""
            if self.store.compare_and_swap("closed", _dumps({"status": "failed", "message": rnd["failure"] + suffix}), expected_revision=0):
                if self.events:
                    self.events.emit(EventType.JOB_FAILED, reason=rnd["failure"])
            return True
        decision = Decision(Action.RESTART, tuple(rnd["members"]), f"rank failure: {rnd['failure']}")
        self._publish_round(snap, list(rnd["members"]), decision, RestartReason.FAILURE, count_restart=True)
        return True

    def _new_event(
        self,
        snap: dict[str, Any],
        *,
        kind: str,
        next_members: list[str] | None,
        reason: str,
        action: Action,
        failure: str | None = None,
    ) -> None:
        prev = snap["event"]
        event_id = (prev["id"] if prev else 0) + 1
        ev = {
            "id": event_id, "round": snap["round"]["round"], "kind": kind, "next": next_members, "reason": reason,
            "action": action.value, "target": None, "decided_at": self.clock(), "failure": failure,
        }  # fmt: skip
        if self.store.compare_and_swap("event", _dumps(ev), expected_revision=snap["event_rev"]):
            log.warning("scale event %d (%s): %s", event_id, kind, reason)
            self._record(snap["round"]["round"], f"event {event_id} ({kind}, {action.value})", reason)
            if self.events:
                self.events.emit(EventType.SCALE_DECIDED, event_id=event_id, kind=kind, action=action.value, reason=reason, next_members=next_members)

    def _drive_event(self, snap: dict[str, Any], ev: dict[str, Any], now: float) -> None:
        members = [m for m in snap["round"]["members"] if m in snap["nodes"]]
        if ev["kind"] == "save" and ev.get("target") is None:
            acks = {k.rsplit("/", 1)[1]: _loads(e.value) for k, e in self.store.get_prefix(f"ack/{ev['id']}/").items()}
            missing = [m for m in members if m not in acks]
            if missing:
                if now - ev["decided_at"] > self.settings.ack_timeout:
                    self._update_event(snap, {**ev, "kind": "stop", "reason": ev["reason"] + f"; no ack from {missing} within {self.settings.ack_timeout:g}s"})
                return
            if all(a["cooperative"] for a in acks.values()):
                # Ranks kept stepping since they acked (all acks came after decided_at): budget for it.
                target = choose_target_step(
                    [a["step"] for a in acks.values()], [a["step_time"] for a in acks.values()],
                    propagation=self.settings.propagation + max(0.0, now - ev["decided_at"]),
                )
            else:
                target = -1
            self._update_event(snap, {**ev, "target": target})
            return
        stopped = {k.rsplit("/", 1)[1] for k in self.store.get_prefix(f"stopped/{ev['id']}/")}
        waiting = [m for m in members if m not in stopped]
        deadline = ev["decided_at"] + self.policy.graceful_shutdown_timeout + self.settings.ack_timeout
        if waiting and now < deadline:
            return
        self._finish_event(snap, ev, now)

    def _update_event(self, snap: dict[str, Any], ev: dict[str, Any]) -> None:
        self.store.compare_and_swap("event", _dumps(ev), expected_revision=snap["event_rev"])

    def _finish_event(self, snap: dict[str, Any], ev: dict[str, Any], now: float) -> None:
        """Every member's ranks have exited: publish the next round (or halt, or close)."""
        rnd = snap["round"]
        if not self.store.compare_and_swap("event", _dumps({**ev, "complete": True}), expected_revision=snap["event_rev"]):
            return
        nxt = ev.get("next")
        if nxt:
            reason = RestartReason.FAILURE if ev["kind"] == "stop" else RestartReason.SCALE
            decision = Decision(Action(ev["action"]), tuple(nxt), ev["reason"])
            self._publish_round(snap, nxt, decision, reason, count_restart=False)
        else:
            halted = {
                **rnd, "state": "halted", "insufficient": nxt == [], "failed": ev["kind"] == "stop",
                "failure": ev.get("failure"), "halted_at": now,
            }  # fmt: skip
            self.store.compare_and_swap("round", _dumps(halted), expected_revision=snap["round_rev"])

    def _publish_round(
        self, snap: dict[str, Any], members: list[str], decision: Decision, reason: RestartReason, *, count_restart: bool
    ) -> None:
        rnd = snap["round"]
        head = snap["nodes"].get(members[0]) or {}
        events = list(rnd.get("events", [])) if rnd else []
        events = (events + [self.clock()])[-16:]
        new = {
            "round": (rnd["round"] if rnd else 0) + 1, "members": members, "state": "running",
            "master_addr": head.get("addr", self.local_addr), "master_port": head.get("port") or free_port(self.local_addr),
            "restarts": (rnd.get("restarts", 0) if rnd else 0) + int(count_restart),
            "events": events, "reason": reason.value, "why": decision.reason,
        }  # fmt: skip
        if self.store.compare_and_swap("round", _dumps(new), expected_revision=snap["round_rev"]):
            log.warning("round %d: %d node(s) x %d rank(s) (%s)", new["round"], len(members), self.nproc, decision.reason)
            self._record(new["round"], f"round {new['round']}: {len(members)} node(s), world {len(members) * self.nproc}", decision.reason)

    # -- helpers -------------------------------------------------------------------------

    def _record(self, round_no: int, what: str, reason: str, keep: int = 50) -> None:
        """Append to the job's bounded decision history (read by ``hyperpodctl status``)."""
        for _ in range(5):  # CAS retry: only deciders write here, so contention is rare
            entry = self.store.get("history")
            items = _loads(entry.value) if entry else []
            items = (items + [{"ts": self.clock(), "round": round_no, "what": what, "reason": reason}])[-keep:]
            if self.store.compare_and_swap("history", _dumps(items), expected_revision=entry.revision if entry else 0):
                return

    def _is_member(self, snap: dict[str, Any]) -> bool:
        rnd = snap["round"]
        return bool(rnd) and self._node_id in rnd["members"] and rnd["state"] == "running"

    def _put_once(self, key: str, value: dict[str, Any]) -> None:
        self.store.compare_and_swap(key, _dumps(value), expected_revision=0)

    def _wait(self, decider: bool, rev: int) -> None:
        """Sleep until something this node acts on changes: any key for the decider, ``round`` for others.

        Others do not wake for every join, so a rendezvous of N nodes costs O(N) store
        operations in all, not O(N^2)."""
        self.store.wait_for_change("" if decider else "round", after_revision=rev, timeout=self.settings.tick * 5)

    def _round_info(self, rnd: dict[str, Any]) -> RoundInfo:
        members = rnd["members"]
        group_rank = members.index(self._node_id)
        if self.events:
            self.events.round, self.events.world_size = rnd["round"], len(members) * self.nproc
        return RoundInfo(
            round=rnd["round"],
            assignment=GroupAssignment(
                group_rank=group_rank,
                group_world_size=len(members),
                nproc_per_node=self.nproc,
                master_addr=rnd["master_addr"],
                master_port=int(rnd["master_port"]),
            ),
            members=tuple(members),
            reason=RestartReason(rnd.get("reason", "start")),
            restarts=int(rnd.get("restarts", 0)),
        )


def create_elastic_rendezvous(config: LaunchConfig, *, policy: ElasticPolicy, events: EventLog | None = None) -> ElasticRendezvous:
    """Connect to (or host) the job's store and build this node's rendezvous."""
    settings = RendezvousSettings.from_conf({k: v for k, v in config.rdzv_conf.items()})
    endpoint = config.rdzv_endpoint or "127.0.0.1:29400"
    store = create_store(
        config.rdzv_backend, endpoint, run_id=config.rdzv_id, conf=config.rdzv_conf, timeout=settings.store_timeout
    )
    host, port = parse_endpoint(endpoint.split(",")[0], default_port=2379 if "etcd" in config.rdzv_backend else 29400)
    local_addr = config.local_addr or route_address(host, port)
    return ElasticRendezvous(
        store,
        policy=policy,
        nproc_per_node=config.nproc_per_node,
        local_addr=local_addr,
        max_restarts=config.max_restarts,
        settings=settings,
        events=events,
        max_world_size=config.max_world_size,
    )
