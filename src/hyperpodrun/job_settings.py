"""Every node of a job must run it with the same settings; a node that differs is refused.

Two launches that share a ``--rdzv-id`` by mistake, or one node started with another
``--nproc-per-node``, would otherwise form rounds whose world sizes and policies disagree
from node to node. Each agent publishes :func:`job_settings` in its node record; a joining
agent compares its own with every other node's (:func:`settings_conflict`) and leaves with
one line naming the first setting that differs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hyperpodrun.errors import RendezvousError
from hyperpodrun.policy_file import FLAG_NAMES

__all__ = ["JobSettingsMismatchError", "check_join", "job_settings", "settings_conflict"]

# Setting -> how the user sets it, for the error message.
_FLAGS = {"nproc": "--nproc-per-node", "max_world_size": "--max-world-size", **FLAG_NAMES}


class JobSettingsMismatchError(RendezvousError):
    """This node's settings differ from those of a node already in the job."""

    exit_code = 2


def job_settings(*, nproc_per_node: int, policy: Any, max_world_size: int | None) -> dict[str, Any]:
    """The settings every node of a job must share, as JSON-ready values."""
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    if fields.get("replica_discrete_values") is not None:
        fields["replica_discrete_values"] = list(fields["replica_discrete_values"])
    return {"nproc": nproc_per_node, "max_world_size": max_world_size, **fields}


def settings_conflict(mine: Mapping[str, Any], others: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first setting in which another node (by id) differs from ``mine``, as one line."""
    for node, theirs in sorted(others.items()):
        for name in mine:
            if name in theirs and theirs[name] != mine[name]:
                flag = _FLAGS.get(name, name)
                return (
                    f"node {node} of this job runs with {flag} {_show(theirs[name])}, this node with "
                    f"{_show(mine[name])}: every node of a job needs the same settings "
                    "(or is this another job? then give it its own --rdzv-id)"
                )
    return None


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def check_join(store: Any, node_id: str, mine: Mapping[str, Any]) -> None:
    """Raise :class:`JobSettingsMismatchError` if a node already in the store differs."""
    others = {}
    for key, entry in store.get_prefix("nodes/").items():
        node = key.removeprefix("nodes/")
        try:
            record = json.loads(entry.value)
        except ValueError:
            continue  # not ours to judge here; the rendezvous reports unreadable records
        if node != node_id and isinstance(record, dict) and isinstance(record.get("settings"), dict):
            others[node] = record["settings"]
    if problem := settings_conflict(mine, others):
        raise JobSettingsMismatchError(problem)
