"""The contract between a hyperpodrun agent and its ranks, written once for both sides.

``elastic_events`` never imports ``hyperpodrun``; the launcher imports this module. What crosses
from the agent to a rank at its start is its environment: torchrun's variables exactly, plus
``HYPERPODRUN_*`` extras. A rank reads it once, into a :class:`RankContext`; after that the
rank's current round lives in memory (:mod:`elastic_events.rounds.engine`) and the environment is
never written back. What crosses while the rank runs is the node-local control channel
(:mod:`elastic_events.control`) and the event log, whose record kinds are :class:`Record`.

* :class:`GroupAssignment`: where one node's ranks sit in one round, and the world and rank
  arithmetic that follows (the only place it is written).
* :func:`rank_environment`: the torchrun variables of one rank of a round.
* :class:`RankContext`: what a rank was started with, validated.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from elastic_events.errors import ElasticTrainingError

# Environment the agent gives every rank, beyond torchrun's variables.
CONTROL_FILE_ENV = "HYPERPODRUN_CONTROL_FILE"  # the node-local control channel
RESTART_REASON_ENV = "HYPERPODRUN_RESTART_REASON"  # start, scale or failure
ROUND_ENV = "HYPERPODRUN_ROUND"  # the rendezvous round the rank starts in
NODE_ID_ENV = "HYPERPODRUN_NODE_ID"
EVENT_LOG_ENV = "HYPERPODRUN_EVENT_LOG"  # where trainer records go (JSON lines, shared with the agent)
PARKED_ENV = "HYPERPODRUN_PARKED"  # "1": a pre-warmed joiner, no rank until admitted
SNAPSHOT_EVERY_ENV = "HYPERPODRUN_SNAPSHOT_EVERY"  # --snapshot-every: a sharded model's in-memory snapshots
ENV_PREFIX = "HYPERPODRUN_"

#: ``--snapshot-every auto``: the interval is chosen per round by what a snapshot costs.
AUTO: Literal["auto"] = "auto"
SnapshotEvery = int | Literal["auto"]  # steps between a sharded model's snapshots (0: none), or AUTO


def is_snapshot_every(value: object) -> bool:
    """Whether ``value`` is a :data:`SnapshotEvery`: ``"auto"`` or an integer >= 0 (not a bool)."""
    return value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def parse_snapshot_every(text: str) -> SnapshotEvery:
    """``"auto"`` or an integer >= 0; ``ValueError`` naming the accepted forms otherwise."""
    value = text.strip().lower()
    if value == AUTO:
        return AUTO
    try:
        every = int(value)
    except ValueError:
        every = -1
    if every < 0:
        raise ValueError(f"expected 'auto' or an integer >= 0 (0: no snapshots), got {text!r}")
    return every


#: The snapshot interval when neither the script nor the launcher sets one: chosen by its cost
#: (elastic_events.rounds.snapshot_interval).
DEFAULT_SNAPSHOT_EVERY: SnapshotEvery = AUTO

#: torchrun's variables that change with the round; a parked rank has none of them until admitted.
ROUND_VARIABLES = (
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class ContractError(ElasticTrainingError, ValueError):
    """A rank's environment does not hold what a launcher must give it."""


class RestartReason(str, Enum):
    """Why a rank's process was started; exported as ``HYPERPODRUN_RESTART_REASON``."""

    START = "start"
    SCALE = "scale"
    FAILURE = "failure"


class Record(str, Enum):
    """Kinds of event-log records: the agents' and the ranks' (``source: trainer``) alike."""

    # the agents'
    AGENT_STARTED = "agent_started"
    RENDEZVOUS_DONE = "rendezvous_done"
    WORKERS_STARTED = "workers_started"
    SCALE_DECIDED = "scale_decided"
    ROUND_IN_PROCESS = "round_in_process"  # every rank declared the in-process API: events are handled in place
    SCALE_TARGETED = "scale_targeted"  # the agreed step and the mode (reconfigure in place or restart)
    WORKERS_SIGNALLED = "workers_signalled"
    WORKERS_STOPPED = "workers_stopped"
    WORKERS_RECONFIGURED = "workers_reconfigured"  # every local rank runs in the next round, in place
    WORKER_FAILED = "worker_failed"
    RANKS_REPLACED = "ranks_replaced"  # failed ranks restarted parked: the job repairs its group in place
    SPARE_READY = "spare_ready"  # a pre-started replacement waits beside the ranks (elastic_events.rounds.spare)
    RANK_HUNG = "rank_hung"  # no progress for --hang-timeout: stacks dumped, treated as a failure
    NODE_LOST = "node_lost"
    NODE_LEAVING = "node_leaving"
    NODE_REJOINED = "node_rejoined"  # registered again after its lease expired during a store outage
    STORE_UNREACHABLE = "store_unreachable"  # the ranks keep training until the lease expires
    STORE_RECOVERED = "store_recovered"
    STORE_LOST = "store_lost"
    SCALE_HELD = "scale_held"  # no scale event in a round where training finished (a joiner would train it again)
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    AGENT_STOPPED = "agent_stopped"
    # the ranks'
    FIRST_STEP = "first_step"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    GROUP_TORN_DOWN = "group_torn_down"
    GROUP_UP = "group_up"
    HYDRATED = "hydrated"
    PEER_FAILED = "peer_failed"  # a collective failed: the rank waits for its group to be repaired
    STEP_ABANDONED = "step_abandoned"  # a step's collectives did not complete: nothing of it was applied
    SNAPSHOT_INTERVAL = "snapshot_interval"  # the interval --snapshot-every auto chose for a round, and why
    SNAPSHOT_RESTORED = "snapshot_restored"  # a sharded model put back together from snapshots after a failure
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"  # no step at which every shard survived: the checkpoint instead
    STEP_ROLLED_BACK = "step_rolled_back"  # HSDP: a step applied on some shard indices only, trained again
    STATE_LOST = "state_lost"  # no rank, snapshot or checkpoint held the state: training starts again at step 0
    IN_PLACE_UNAVAILABLE = "in_place_unavailable"  # a framework rank does not offer in-place events (reason)
    RESTART_REQUESTED = "restart_requested"  # a rank that offered in-place events was asked to save and restart
    TRAINING_FINISHED = "training_finished"  # the rank's training ended: no event will be acted on
    STATE_HELD = "state_held"  # below the job's minimum: the survivors saved and hold the state in memory


@dataclass(frozen=True, kw_only=True)
class GroupAssignment:
    """Where one node's ranks sit in one round: ranks are contiguous per node, node by node."""

    group_rank: int
    group_world_size: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.group_world_size * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.nproc_per_node:
            raise ContractError(f"local rank {local_rank} is outside this node's {self.nproc_per_node} ranks")
        return self.group_rank * self.nproc_per_node + local_rank


def rank_environment(assignment: GroupAssignment, local_rank: int, *, round: int) -> dict[str, str]:
    """torchrun's round variables of one rank (and the round's number), for a process started into it."""
    rank = assignment.global_rank(local_rank)
    return {
        "RANK": str(rank),
        "GROUP_RANK": str(assignment.group_rank),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(assignment.world_size),
        "GROUP_WORLD_SIZE": str(assignment.group_world_size),
        "ROLE_WORLD_SIZE": str(assignment.world_size),
        "MASTER_ADDR": assignment.master_addr,
        "MASTER_PORT": str(assignment.master_port),
        ROUND_ENV: str(round),
    }


def _snapshot_every(raw: str) -> SnapshotEvery:
    try:
        return parse_snapshot_every(raw)
    except ValueError as exc:
        raise ContractError(f"{SNAPSHOT_EVERY_ENV}={raw!r}: {exc}") from None


def _int(env: Mapping[str, str], name: str, default: int | None = None, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ContractError(f"{name} is not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise ContractError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What this process was started with, read once from its environment (:meth:`from_env`).

    ``rank``/``world_size`` are the round the process started in (0 and 1 for a plain script or a
    parked joiner); the rank's current round lives in its round engine, never here.
    """

    local_rank: int = 0
    local_world_size: int = 1
    rank: int = 0
    world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    round: int = 0
    master_addr: str = ""
    master_port: int = 0
    launched: bool = False  # RANK and WORLD_SIZE are set: torchrun or hyperpodrun started it
    parked: bool = False  # a pre-warmed joiner: no rank until a RECONFIGURE event admits its node
    control_file: str | None = None  # hyperpodrun's control channel (None: not under hyperpodrun)
    event_log: str | None = None
    node_id: str = ""
    run_id: str = ""
    restart_reason: RestartReason = RestartReason.START
    snapshot_every: SnapshotEvery | None = None  # the launcher's --snapshot-every (None: not given)

    def __post_init__(self) -> None:
        if not 0 <= self.local_rank < self.local_world_size:
            raise ContractError(f"LOCAL_RANK {self.local_rank} is outside LOCAL_WORLD_SIZE {self.local_world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ContractError(f"RANK {self.rank} is outside WORLD_SIZE {self.world_size}")
        if self.parked and self.control_file is None:
            raise ContractError(
                f"{PARKED_ENV}=1 needs the control channel ({CONTROL_FILE_ENV}): only hyperpodrun parks ranks"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankContext:
        """Read and check the variables a launcher sets (``os.environ`` unless ``env`` is given)."""
        env = os.environ if env is None else env
        parked = env.get(PARKED_ENV) == "1"
        if not parked and "RANK" in env and "WORLD_SIZE" not in env:
            raise ContractError("RANK is set but WORLD_SIZE is not: launch with torchrun or hyperpodrun")
        launched = not parked and "RANK" in env
        reason = env.get(RESTART_REASON_ENV, RestartReason.START.value)
        try:
            restart_reason = RestartReason(reason)
        except ValueError:
            raise ContractError(
                f"{RESTART_REASON_ENV}={reason!r}: expected one of {', '.join(r.value for r in RestartReason)}"
            ) from None
        every = env.get(SNAPSHOT_EVERY_ENV)
        return cls(
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1),
            rank=_int(env, "RANK", 0) if launched else 0,
            world_size=_int(env, "WORLD_SIZE", 1, minimum=1) if launched else 1,
            group_rank=_int(env, "GROUP_RANK", 0) if launched else 0,
            group_world_size=_int(env, "GROUP_WORLD_SIZE", 1, minimum=1) if launched else 1,
            round=_int(env, ROUND_ENV, 0),
            master_addr=env.get("MASTER_ADDR", "") if launched else "",
            master_port=_int(env, "MASTER_PORT", 0) if launched else 0,
            launched=launched,
            parked=parked,
            control_file=env.get(CONTROL_FILE_ENV) or None,
            event_log=env.get(EVENT_LOG_ENV) or None,
            node_id=env.get(NODE_ID_ENV, ""),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            restart_reason=restart_reason,
            snapshot_every=None if every is None else _snapshot_every(every),
        )

    @property
    def under_hyperpodrun(self) -> bool:
        return self.control_file is not None

    @property
    def assignment(self) -> GroupAssignment:
        """The place of this process's node in the round it was started in."""
        return GroupAssignment(
            group_rank=self.group_rank,
            group_world_size=self.group_world_size,
            nproc_per_node=self.local_world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
        )


@functools.cache
def rank_context() -> RankContext:
    """This process's :class:`RankContext`, read from the environment on first use (``cache_clear()``
    makes the next call read it again: for tests that change the environment of their own process)."""
    return RankContext.from_env()
