"""The agent's line for a round that holds the job's state below the minimum (:mod:`.rendezvous.hold`)."""

from __future__ import annotations

__all__ = ["held_line"]


def held_line(round_no: int, min_nodes: int | None) -> str:
    """What the agent says when its ranks move into a held round (their rank 0 names the step and the checkpoint)."""
    minimum = f" (--nnodes minimum {min_nodes})" if min_nodes is not None else ""
    return (
        f"round {round_no}: too few nodes to train{minimum}: the ranks saved a checkpoint and hold the state "
        "in memory (rank 0's line names the step and the checkpoint); nodes that join resume it in place"
    )
