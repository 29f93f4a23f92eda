"""``hyperpodctl``: inspect and steer a running elastic job through its store.

Everything goes through the job's store (``--rdzv-backend``/``--rdzv-endpoint``/
``--rdzv-id``/``--rdzv-conf``, the same values and ``PET_*`` variables the job was
launched with); ``hyperpodctl`` never hosts an embedded store, it only connects.

* ``status``: members in group-rank order, world size, round, standbys, leaving and
  lost nodes, the pending scale event (its kind, mode and what the ranks do), the
  operator cap, and recent decisions.
* ``cap N`` / ``uncap``: bound the job to at most ``N`` replicas (key ``ctl/cap``).
* ``yield K``: give back ``K`` replicas now (a cap ``K`` below the current size).
* ``events``: the job's decision history, optionally followed as it grows.

Parts: :mod:`.status` (pure: the job's typed records -> :class:`JobStatus` -> text),
:mod:`.job` (connection and reading the records), :mod:`.steer` (cap, yield, follow),
:mod:`.commands` (the typer commands). The key layout and the records are
:mod:`hyperpodrun.rendezvous.records`, shared with the rendezvous.
"""

from __future__ import annotations

from hyperpodrun.ctl.commands import app
from hyperpodrun.ctl.job import ConnectionSettings, read_job
from hyperpodrun.ctl.status import (
    CtlError,
    JobClosedError,
    JobRecords,
    JobState,
    JobStatus,
    Member,
    MemberState,
    NoSuchJobError,
    PendingEvent,
    job_status,
    render_status,
)
from hyperpodrun.ctl.steer import FollowEnd, cap_after_yield, follow_history, set_cap, yield_replicas
from hyperpodrun.rendezvous.records import HistoryEntry

__all__ = [
    "ConnectionSettings",
    "CtlError",
    "FollowEnd",
    "HistoryEntry",
    "JobClosedError",
    "JobRecords",
    "JobState",
    "JobStatus",
    "Member",
    "MemberState",
    "NoSuchJobError",
    "PendingEvent",
    "app",
    "cap_after_yield",
    "follow_history",
    "job_status",
    "main",
    "read_job",
    "render_status",
    "set_cap",
    "yield_replicas",
]


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``hyperpodctl``): returns the process exit status."""
    from hyperpodrun.cli import run_app

    return run_app(app, "hyperpodctl", argv)
