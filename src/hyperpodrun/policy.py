"""Elastic policy: which replica counts a job may run at, and when to change them.

:class:`ElasticPolicy` holds the user's settings (``--nnodes MIN:MAX`` plus HyperPod's
``elasticPolicy`` fields and hyperpodrun's anti-thrashing knobs). :func:`decide` is a pure
function of the policy, a snapshot of the cluster (:class:`ClusterView`) and the current
time: it reads no clock, never sleeps and does no I/O, so the agent owns every wait and
every rule here is unit-testable in microseconds.

Conventions:

* A replica is one node's agent with its ``nproc_per_node`` ranks.
* Every timer fires *at* its deadline: ``now >= deadline`` means it has expired.
* Forced changes (a member leaving, a lost member past ``faulty_scale_down_timeout``, an
  operator cap or world-size limit below the current size, a current size the policy does
  not allow) act at once as SCALE_DOWN, refilled from standbys where possible. Only
  scale-ups wait for stable capacity (``scaling_timeout``) and the anti-thrashing period.
* Anti-thrashing backs off reversals, not growth: a job that grows (or shrinks) step after
  step keeps the base stable period; only changes of direction within ``backoff_window``
  lengthen it (:func:`required_stable_period`).
* Arrivals that come together are admitted together: once a scale-up is due, every standby
  present joins in the same scale event, up to the largest allowed size within the limits.
* New memberships keep the existing members first, in their current group-rank order;
  newcomers follow by join time, then node id. The rank-0 node is therefore always an
  existing training member when one survives.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from hyperpodrun.errors import ConfigError

__all__ = [
    "Action",
    "ClusterView",
    "ClusterViewError",
    "Decision",
    "ElasticPolicy",
    "MEMBERSHIP_ACTIONS",
    "NodeState",
    "PolicyError",
    "ScaleEvent",
    "decide",
    "required_stable_period",
]


class PolicyError(ConfigError):
    """An elastic policy setting is invalid or contradicts another; ``fields`` names them."""

    def __init__(self, message: str, *, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class ClusterViewError(ValueError):
    """A :class:`ClusterView` is inconsistent: a bug in the caller, not in user input."""


# --------------------------------------------------------------------------- policy


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PolicyError(f"{name} must be an integer, got {value!r}", fields=(name,))
    if value < minimum:
        raise PolicyError(f"{name} must be >= {minimum}, got {value}", fields=(name,))


def _check_number(name: str, value: object, *, minimum: float, strict: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise PolicyError(f"{name} must be a finite number, got {value!r}", fields=(name,))
    if value < minimum or (strict and value == minimum):
        raise PolicyError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}", fields=(name,))
    return float(value)


@dataclass(frozen=True, kw_only=True)
class ElasticPolicy:
    """The replica counts a job may run at and the timers that govern changes.

    Allowed sizes: ``replica_discrete_values`` when set, else ``min_replicas``,
    ``min_replicas + replica_increment_step``, ... up to ``max_replicas``, else every count
    in ``[min_replicas, max_replicas]``. All durations are in seconds.

    Defaults: ``graceful_shutdown_timeout`` 120 s (SageMaker's SIGTERM-to-kill window, time
    enough for a DCP save), ``scaling_timeout`` 60 s, ``faulty_scale_down_timeout`` 30 s.
    Anti-thrashing: a scale-up needs ``min_stable_period`` (60 s) since the previous scale
    event; each reversal of direction (a shrink after a growth or the other way round) among
    the recent events, each within ``backoff_window`` (900 s) of the next, multiplies that
    period by ``backoff_factor`` (2), up to ``max_backoff`` (600 s). Growth streaks keep the
    base period. See :func:`required_stable_period`.
    """

    min_replicas: int
    max_replicas: int
    replica_increment_step: int | None = None
    replica_discrete_values: tuple[int, ...] | None = None
    graceful_shutdown_timeout: float = 120.0
    scaling_timeout: float = 60.0
    faulty_scale_down_timeout: float = 30.0
    min_stable_period: float = 60.0
    backoff_window: float = 900.0
    backoff_factor: float = 2.0
    max_backoff: float = 600.0
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("min_replicas", self.min_replicas, minimum=1)
        _check_int("max_replicas", self.max_replicas, minimum=1)
        if self.max_replicas < self.min_replicas:
            raise PolicyError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})",
                fields=("max_replicas", "min_replicas"),
            )
        if self.replica_increment_step is not None and self.replica_discrete_values is not None:
            raise PolicyError(
                "replica_increment_step and replica_discrete_values are mutually exclusive; set at most one",
                fields=("replica_increment_step", "replica_discrete_values"),
            )
        if self.replica_increment_step is not None:
            _check_int("replica_increment_step", self.replica_increment_step, minimum=1)
            sizes = tuple(range(self.min_replicas, self.max_replicas + 1, self.replica_increment_step))
        elif self.replica_discrete_values is not None:
            sizes = self._checked_discrete_values()
        else:
            sizes = tuple(range(self.min_replicas, self.max_replicas + 1))
        object.__setattr__(self, "_sizes", sizes)

        for name, minimum, strict in (
            ("graceful_shutdown_timeout", 0.0, True),
            ("scaling_timeout", 0.0, False),
            ("faulty_scale_down_timeout", 0.0, False),
            ("min_stable_period", 0.0, False),
            ("backoff_window", 0.0, False),
            ("backoff_factor", 1.0, False),
            ("max_backoff", 0.0, False),
        ):
            object.__setattr__(self, name, _check_number(name, getattr(self, name), minimum=minimum, strict=strict))
        if self.max_backoff < self.min_stable_period:
            raise PolicyError(
                f"max_backoff ({self.max_backoff:g}) must be >= min_stable_period ({self.min_stable_period:g})",
                fields=("max_backoff", "min_stable_period"),
            )
        if self.max_backoff > self.backoff_window:
            raise PolicyError(
                f"max_backoff ({self.max_backoff:g}) must be <= backoff_window ({self.backoff_window:g}): "
                "a scale event more than backoff_window after the previous one restarts the backoff",
                fields=("max_backoff", "backoff_window"),
            )

    def _checked_discrete_values(self) -> tuple[int, ...]:
        name = "replica_discrete_values"
        values = self.replica_discrete_values
        if not isinstance(values, tuple) or not values:
            raise PolicyError(f"{name} must be a non-empty tuple of integers, got {values!r}", fields=(name,))
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool):
                raise PolicyError(f"{name} must contain only integers, got {v!r} in {values!r}", fields=(name,))
            if not self.min_replicas <= v <= self.max_replicas:
                raise PolicyError(
                    f"{name}: {v} is outside [min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]",
                    fields=(name, "min_replicas", "max_replicas"),
                )
        if any(a >= b for a, b in zip(values, values[1:])):
            raise PolicyError(f"{name} must be sorted ascending without duplicates, got {values!r}", fields=(name,))
        return values

    def allowed_sizes(self) -> tuple[int, ...]:
        """Every replica count the job may run at, ascending."""
        return self._sizes

    def largest_allowed_at_most(self, n: int) -> int | None:
        """The largest allowed replica count ``<= n``, or None when even the smallest is larger."""
        i = bisect.bisect_right(self._sizes, n)
        return self._sizes[i - 1] if i else None

    def validate_world(self, *, nproc_per_node: int, max_world_size: int | None = None) -> tuple[int, ...]:
        """The allowed sizes whose world (replicas x nproc) fits ``max_world_size``.

        Call at start-up: raises :class:`PolicyError` when none fits, e.g. when a global batch
        has fewer samples than the smallest allowed world has ranks.
        """
        limit = _replica_limit(self, None, nproc_per_node, max_world_size)
        fitting = tuple(s for s in self._sizes if s <= limit.replicas)
        if not fitting:
            smallest = self._sizes[0]
            raise PolicyError(
                f"no allowed replica count fits max_world_size={max_world_size}: the smallest allowed count "
                f"{smallest} x nproc_per_node {nproc_per_node} = {smallest * nproc_per_node} ranks; "
                "lower the minimum replica count or --nproc-per-node, or raise the global batch size",
                fields=("min_replicas",),
            )
        return fitting


def _reversals(events: tuple[ScaleEvent, ...], first: int) -> int:
    """Changes of direction among ``events[first:]``; a round of the same size (a restart, or
    one whose predecessor is unknown) has no direction and neither flips nor breaks a streak."""
    flips, previous = 0, 0
    for i in range(max(first, 1), len(events)):
        direction = (events[i].replicas > events[i - 1].replicas) - (events[i].replicas < events[i - 1].replicas)
        if direction:
            flips += previous not in (0, direction)
            previous = direction
    return flips


def required_stable_period(policy: ElasticPolicy, last_events: tuple[ScaleEvent, ...], now: float) -> float:
    """Seconds that must separate the last scale event from a scale-up at ``now``.

    The base is ``min_stable_period``. The recent events are those counted back from the
    newest while each came within ``backoff_window`` of its successor; every reversal among
    them (a shrink after a growth, a growth after a shrink; each event's direction is its size
    against its predecessor's) multiplies the base by ``backoff_factor``, capped at
    ``max_backoff``. Growth after growth, or shrink after shrink, never lengthens it, so a job
    that grows one node at a time waits the base period for each. A scale-up at ``now`` more
    than ``backoff_window`` after the newest event is unrelated to them and needs only the base.
    """
    if not last_events or now - last_events[-1].at > policy.backoff_window:
        return policy.min_stable_period
    first = len(last_events) - 1
    while first > 0 and last_events[first].at - last_events[first - 1].at <= policy.backoff_window:
        first -= 1
    # Multiply step by step and stop at the cap, so a long history cannot overflow.
    period = policy.min_stable_period
    for _ in range(_reversals(last_events, first)):
        period *= policy.backoff_factor
        if period >= policy.max_backoff:
            return policy.max_backoff
    return period


# --------------------------------------------------------------------------- data model


class Action(str, Enum):
    """What the agent should do after a :func:`decide` call."""

    NONE = "none"  # keep going; call again at recheck_at or on the next change
    START = "start"  # first round (or resume after INSUFFICIENT) with Decision.members
    SCALE_UP = "scale_up"  # grow to Decision.members (existing members first)
    SCALE_DOWN = "scale_down"  # forced reshape: drop departed members, refill from standbys
    RESTART = "restart"  # lost members came back in time: restart at the same membership
    WAIT_FOR_LOST = "wait_for_lost"  # members are lost; wait until recheck_at for them to return
    INSUFFICIENT = "insufficient"  # no allowed size can be formed; stop and wait for nodes


MEMBERSHIP_ACTIONS = frozenset({Action.START, Action.SCALE_UP, Action.SCALE_DOWN, Action.RESTART})
"""Actions whose :class:`Decision` carries the membership of the next round."""


def _check_time(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ClusterViewError(f"{name} must be a finite time in seconds, got {value!r}")


@dataclass(frozen=True)
class NodeState:
    """A node whose lease is alive; ``leaving`` = it asked to leave gracefully (SIGTERM)."""

    node_id: str
    joined_at: float
    leaving: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ClusterViewError(f"NodeState.node_id must be a non-empty string, got {self.node_id!r}")
        _check_time(f"NodeState({self.node_id}).joined_at", self.joined_at)


@dataclass(frozen=True)
class ScaleEvent:
    """A new round of the job: when it was published and how many replicas it has."""

    at: float
    replicas: int

    def __post_init__(self) -> None:
        _check_time("ScaleEvent.at", self.at)
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ClusterViewError(f"ScaleEvent.replicas must be an integer >= 1, got {self.replicas!r}")


@dataclass(frozen=True)
class ClusterView:
    """A snapshot of the job, assembled by the agent from the store.

    ``members`` is empty before the first round and after the caller acted on
    INSUFFICIENT (the workers are stopped); :func:`decide` then applies the start rules.
    A member absent from ``alive`` and from ``lost_since`` has departed (e.g. its lease was
    revoked after a graceful leave) and is dropped at once; a member in ``lost_since`` gets
    ``faulty_scale_down_timeout`` to come back. Record in ``last_events`` every new round
    (START, SCALE_UP, SCALE_DOWN, RESTART) as a :class:`ScaleEvent`, oldest first, so a
    scale-up right after start or after a forced shrink is also rate-limited, and reversals
    of direction can be told from growth streaks.
    ``capacity_since``, when tracked, further delays scale-ups: the newcomers must have been
    alive (``joined_at``) *and* the capacity available (``capacity_since``) for
    ``scaling_timeout``.
    """

    round: int
    members: tuple[str, ...]
    alive: Mapping[str, NodeState]
    lost_since: Mapping[str, float]
    last_events: tuple[ScaleEvent, ...] = ()
    cap: int | None = None
    capacity_since: float | None = None
    first_min_reached_at: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.round, int) or isinstance(self.round, bool) or self.round < 0:
            raise ClusterViewError(f"ClusterView.round must be an integer >= 0, got {self.round!r}")
        if len(set(self.members)) != len(self.members):
            raise ClusterViewError(f"ClusterView.members has duplicates: {self.members!r}")
        if self.round == 0 and self.members:
            raise ClusterViewError(f"ClusterView.members must be empty in round 0, got {self.members!r}")
        for node_id, state in self.alive.items():
            if state.node_id != node_id:
                raise ClusterViewError(f"ClusterView.alive[{node_id!r}] holds the state of {state.node_id!r}")
        for node_id, since in self.lost_since.items():
            if node_id not in self.members:
                raise ClusterViewError(f"ClusterView.lost_since names {node_id!r}, which is not a member")
            _check_time(f"ClusterView.lost_since[{node_id!r}]", since)
        for event in self.last_events:
            if not isinstance(event, ScaleEvent):
                raise ClusterViewError(f"ClusterView.last_events must hold ScaleEvent records, got {event!r}")
        if any(a.at > b.at for a, b in zip(self.last_events, self.last_events[1:])):
            raise ClusterViewError(f"ClusterView.last_events must be oldest first, got {self.last_events!r}")
        if self.cap is not None and (not isinstance(self.cap, int) or isinstance(self.cap, bool) or self.cap < 0):
            raise ClusterViewError(f"ClusterView.cap must be None or an integer >= 0, got {self.cap!r}")
        for name in ("capacity_since", "first_min_reached_at"):
            if getattr(self, name) is not None:
                _check_time(f"ClusterView.{name}", getattr(self, name))
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "alive", MappingProxyType(dict(self.alive)))
        object.__setattr__(self, "lost_since", MappingProxyType(dict(self.lost_since)))
        object.__setattr__(self, "last_events", tuple(self.last_events))


@dataclass(frozen=True)
class Decision:
    """The outcome of :func:`decide`.

    ``members`` is the next round's membership in group-rank order for the actions in
    :data:`MEMBERSHIP_ACTIONS` and empty otherwise. ``recheck_at`` is the earliest time at
    which calling :func:`decide` again on an unchanged view could answer differently.
    """

    action: Action
    members: tuple[str, ...] = ()
    reason: str = ""
    recheck_at: float | None = None

    def __post_init__(self) -> None:
        if (self.action in MEMBERSHIP_ACTIONS) != bool(self.members):
            raise ValueError(
                f"Decision({self.action.value}): members must be non-empty exactly for "
                f"{', '.join(sorted(a.value for a in MEMBERSHIP_ACTIONS))}"
            )
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"Decision.members has duplicates: {self.members!r}")


# --------------------------------------------------------------------------- decide


@dataclass(frozen=True)
class _Limit:
    """The largest replica count the external constraints admit, and which one binds."""

    replicas: int
    why: str


def _replica_limit(policy: ElasticPolicy, cap: int | None, nproc_per_node: int, max_world_size: int | None) -> _Limit:
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    limit = _Limit(policy.max_replicas, f"max_replicas {policy.max_replicas}")
    if cap is not None and cap < limit.replicas:
        limit = _Limit(cap, f"operator cap {cap}")
    if max_world_size is not None:
        if not isinstance(max_world_size, int) or isinstance(max_world_size, bool) or max_world_size < 1:
            raise ValueError(f"max_world_size must be None or an integer >= 1, got {max_world_size!r}")
        by_world = max_world_size // nproc_per_node
        if by_world < limit.replicas:
            limit = _Limit(by_world, f"max_world_size {max_world_size} at nproc_per_node {nproc_per_node}")
    return limit


def _join_order(state: NodeState) -> tuple[float, str]:
    return (state.joined_at, state.node_id)


def _ids(nodes: list[str] | tuple[str, ...]) -> str:
    return ", ".join(nodes)


def _insufficient(policy: ElasticPolicy, usable: int, limit: _Limit, prefix: str = "") -> Decision:
    smallest = policy.allowed_sizes()[0]
    if limit.replicas < smallest:
        why = f"{limit.why} admits no allowed replica count (the smallest is {smallest})"
    else:
        why = (
            f"{usable} usable node(s), {smallest - usable} more needed for the smallest "
            f"allowed replica count {smallest}"
        )
    return Decision(Action.INSUFFICIENT, reason=prefix + why)


def decide(
    policy: ElasticPolicy,
    view: ClusterView,
    now: float,
    *,
    nproc_per_node: int = 1,
    max_world_size: int | None = None,
    last_call: float | None = None,
) -> Decision:
    """Decide what the job should do at time ``now``; pure and deterministic.

    ``max_world_size`` (ranks) excludes sizes whose world ``replicas x nproc_per_node``
    exceeds it. ``last_call``: at start, how long to wait for more nodes once the minimum is
    alive (torchrun's ``last_call_timeout``), never longer than ``scaling_timeout``; None:
    ``scaling_timeout``. Raises :class:`ClusterViewError` when the view breaks its contract.
    """
    _check_time("now", now)
    limit = _replica_limit(policy, view.cap, nproc_per_node, max_world_size)
    if not view.members:
        wait = policy.scaling_timeout if last_call is None else min(last_call, policy.scaling_timeout)
        return _decide_start(policy, view, now, limit, wait)
    return _decide_running(policy, view, now, limit)


def _decide_start(policy: ElasticPolicy, view: ClusterView, now: float, limit: _Limit, wait: float) -> Decision:
    ready = sorted((s for s in view.alive.values() if not s.leaving), key=_join_order)
    full = policy.largest_allowed_at_most(limit.replicas)
    target = policy.largest_allowed_at_most(min(len(ready), limit.replicas))
    if full is None or target is None:
        return _insufficient(policy, len(ready), limit)
    members = tuple(s.node_id for s in ready[:target])
    if target == full:
        return Decision(Action.START, members, f"starting with {target} replica(s), the most allowed ({limit.why})")
    if view.first_min_reached_at is None:
        raise ClusterViewError(
            f"ClusterView.first_min_reached_at is None although {len(ready)} usable node(s) are alive "
            f"(smallest allowed replica count {policy.allowed_sizes()[0]}); record when it was first reached"
        )
    deadline = view.first_min_reached_at + wait
    if now >= deadline:
        return Decision(
            Action.START,
            members,
            f"{wait:g}s (last call) passed since the minimum was reached; "
            f"starting with {target} of up to {full} replica(s)",
        )
    return Decision(
        Action.NONE,
        reason=f"{len(ready)} usable node(s); waiting until t={deadline:.3f} for up to {full} "
        f"replica(s) before starting with {target}",
        recheck_at=deadline,
    )


def _decide_running(policy: ElasticPolicy, view: ClusterView, now: float, limit: _Limit) -> Decision:
    members, alive = view.members, view.alive
    staying = [m for m in members if m in alive and not alive[m].leaving]
    leaving = [m for m in members if m in alive and alive[m].leaving]
    gone = [m for m in members if m not in alive]
    departed = [m for m in gone if m not in view.lost_since]
    deadlines = {m: view.lost_since[m] + policy.faulty_scale_down_timeout for m in gone if m in view.lost_since}
    expired = [m for m in gone if m in deadlines and now >= deadlines[m]]
    pending = [m for m in gone if m in deadlines and now < deadlines[m]]
    returned = [m for m in staying if m in view.lost_since]
    member_set = set(members)
    standbys = sorted((s for s in alive.values() if s.node_id not in member_set and not s.leaving), key=_join_order)

    forced = []
    if leaving:
        forced.append(f"member(s) leaving: {_ids(leaving)}")
    if expired:
        timeout = policy.faulty_scale_down_timeout
        forced.append(f"member(s) lost for faulty_scale_down_timeout {timeout:g}s: {_ids(expired)}")
    if departed:
        forced.append(f"member(s) departed: {_ids(departed)}")
    if len(members) > limit.replicas:
        forced.append(f"{limit.why} is below the current {len(members)} replica(s)")
    elif len(members) not in policy.allowed_sizes():
        forced.append(f"the current {len(members)} replica(s) is not an allowed replica count")
    if forced:
        if pending:
            forced.append(f"dropping lost member(s) {_ids(pending)} with the reshape")
        return _reshape(policy, staying, standbys, len(members), limit, "; ".join(forced))
    if pending:
        deadline = min(deadlines[m] for m in pending)
        return Decision(
            Action.WAIT_FOR_LOST,
            reason=f"lost member(s) {_ids(pending)}; waiting until t={deadline:.3f} for them to come back",
            recheck_at=deadline,
        )
    grow = _scale_up(policy, view, standbys, limit, now)
    if returned:
        if grow.action is Action.SCALE_UP:
            return Decision(Action.SCALE_UP, grow.members, f"{grow.reason}; lost member(s) {_ids(returned)} came back")
        return Decision(
            Action.RESTART,
            members,
            f"lost member(s) {_ids(returned)} came back within faulty_scale_down_timeout; "
            "restarting at the same membership",
        )
    return grow


def _reshape(
    policy: ElasticPolicy, staying: list[str], standbys: list[NodeState], current: int, limit: _Limit, why: str
) -> Decision:
    """Forced change: keep the staying members, refill from standbys up to the current size.

    Growth beyond the current size is left to a gated scale-up, except up to the smallest
    allowed size when the current one is below it (e.g. the policy changed across a resume).
    """
    usable = len(staying) + len(standbys)
    refill_to = max(current, policy.allowed_sizes()[0])
    target = policy.largest_allowed_at_most(min(usable, refill_to, limit.replicas))
    if target is None:
        return _insufficient(policy, usable, limit, prefix=f"{why}; ")
    refill = [s.node_id for s in standbys[: max(0, target - len(staying))]]
    members = tuple(staying[:target]) + tuple(refill)
    detail = f"; refilled from standby(s) {_ids(refill)}" if refill else ""
    return Decision(Action.SCALE_DOWN, members, f"{why}; {current} -> {target} replica(s){detail}")


def _scale_up(
    policy: ElasticPolicy, view: ClusterView, standbys: list[NodeState], limit: _Limit, now: float
) -> Decision:
    """Grow once the smallest larger allowed size has been fillable for ``scaling_timeout`` and the
    stable period has passed; then admit every standby present, not only those that waited:
    nodes that arrive a moment apart (as the decider happens to see them) join in one event."""
    current = len(view.members)
    reach = min(current + len(standbys), limit.replicas)
    sizes = [s for s in policy.allowed_sizes() if current < s <= reach]
    if not sizes:
        why = "no standby node" if not standbys else f"no larger allowed replica count within {limit.why}"
        return Decision(Action.NONE, reason=f"running at {current} replica(s); {why}")
    capacity_since = -math.inf if view.capacity_since is None else view.capacity_since
    # Standbys are in join order, so the newcomers for sizes[0] joined no later than standbys[sizes[0] - current - 1].
    due = max(capacity_since, standbys[sizes[0] - current - 1].joined_at) + policy.scaling_timeout
    period = required_stable_period(policy, view.last_events, now)
    gate = view.last_events[-1].at + period if view.last_events else -math.inf
    if due > now:
        recheck = max(due, gate)
        return Decision(
            Action.NONE,
            reason=f"{len(standbys)} standby node(s) must stay available for scaling_timeout "
            f"{policy.scaling_timeout:g}s; earliest scale-up to {sizes[0]} replica(s) at t={recheck:.3f}",
            recheck_at=recheck,
        )
    present = sum(1 for s in standbys if s.joined_at <= now)  # a prefix of the join order
    target = max(s for s in sizes if s <= current + present)  # sizes[0] qualifies: its standbys are present
    if gate > now:
        return Decision(
            Action.NONE,
            reason=f"scale-up to {target} replica(s) held back until t={gate:.3f} "
            f"(stable period {period:g}s after the last scale event)",
            recheck_at=gate,
        )
    newcomers = tuple(s.node_id for s in standbys[: target - current])
    return Decision(
        Action.SCALE_UP,
        view.members + newcomers,
        f"standby(s) {_ids(newcomers)} admitted, spare capacity available for scaling_timeout "
        f"{policy.scaling_timeout:g}s; {current} -> {target} replica(s)",
    )
