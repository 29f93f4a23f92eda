"""Below the job's minimum: the survivors keep the state (save, then hold it in memory) until nodes join.

When a running in-process round loses members (a node leaves, fails or is taken away) and the
survivors are too few for any allowed size, the survivors do not throw their state away: the
decider moves them in place into a *held* round of their own (``RoundRecord.held``), whose ranks
save a checkpoint and then wait, the state in memory, without training. From a held round:

* nodes arrive: as soon as an allowed size can be formed (the policy's forced reshape, no
  ``scaling_timeout``), one in-place event admits them; they are hydrated from the survivors and
  training resumes at the held step;
* a member asks to leave (SIGTERM): the others hold on without it; when every member leaves, the
  job halts, its state saved at the hold;
* a member is lost, or a held rank fails: the others stop, and the job halts for lack of nodes; it
  resumes from the checkpoint saved at the hold when nodes come.

Events from a held round are acted on at once (target step 0): its ranks do not step, so there is
no step to agree on. These rules are pure functions of the records; :mod:`.decider` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hyperpodrun.policy import MEMBERSHIP_ACTIONS, Action, Decision, ElasticPolicy
from hyperpodrun.rendezvous.records import EventKind, EventMode, NodeRecord, RoundRecord

__all__ = ["HeldStep", "holds", "next_from_held"]


def holds(members: Sequence[str], policy: ElasticPolicy) -> bool:
    """Whether survivors ``members`` (at least one) must hold the state: no allowed size has that many nodes."""
    return bool(members) and len(members) not in policy.allowed_sizes()


@dataclass(frozen=True, kw_only=True)
class HeldStep:
    """The event a held round needs now (:func:`next_from_held`)."""

    kind: EventKind
    mode: EventMode
    next_members: tuple[str, ...] | None  # () : every member leaves; None: the round halts (STOP)
    reason: str
    hold: bool  # the next round holds the state too


def next_from_held(
    rnd: RoundRecord,
    decision: Decision,
    nodes: Mapping[str, NodeRecord],
    policy: ElasticPolicy,
    *,
    failed: bool,
) -> HeldStep | None:
    """What a held round does next, given the policy's ``decision`` on it; None: hold on."""
    gone = [m for m in rnd.members if m not in nodes]
    if failed or gone:
        why = f"member(s) {', '.join(gone)} lost" if gone else "a rank holding the state failed"
        return HeldStep(
            kind=EventKind.INSUFFICIENT,
            mode=EventMode.STOP,
            next_members=None,
            reason=f"round {rnd.round} held the state below the minimum and {why}: the job halts; it resumes "
            "from the checkpoint saved at the hold",
            hold=False,
        )
    leaving = [m for m in rnd.members if nodes[m].leaving]
    if decision.action in MEMBERSHIP_ACTIONS:
        nxt = decision.members
        newcomers = [m for m in nxt if m not in rnd.members]
        kind = EventKind.JOIN if newcomers else EventKind.LEAVE if leaving else EventKind.YIELD
        return HeldStep(
            kind=kind,
            mode=EventMode.RECONFIGURE,
            next_members=nxt,
            reason=f"resuming the state held since round {rnd.round} in place: {decision.reason}",
            hold=holds(nxt, policy),
        )
    if decision.action is Action.INSUFFICIENT and leaving:
        staying = tuple(m for m in rnd.members if m not in leaving)
        return HeldStep(
            kind=EventKind.LEAVE if staying else EventKind.INSUFFICIENT,
            mode=EventMode.RECONFIGURE,
            next_members=staying,
            reason=f"member(s) {', '.join(leaving)} leave the held round {rnd.round}"
            + ("; the others hold the state on" if staying else "; the state stays saved at the hold"),
            hold=bool(staying),
        )
    return None
