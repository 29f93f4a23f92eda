"""The collectives a checkpoint needs: small Python objects agreed between ranks.

A :class:`Checkpointer` in one process uses :class:`Comm` (no communication, DCP's
``no_dist``); over a process group it uses :class:`GroupComm`, whose group timeout bounds
every wait and whose errors name what the ranks were waiting for.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from elastic_events.checkpoint.layout import CheckpointError

__all__ = ["SINGLE_PROCESS_NOTICE", "Comm", "GroupComm", "quiet_single_process"]

SINGLE_PROCESS_NOTICE = "torch.distributed is disabled, unavailable or uninitialized"


class Comm:
    """Agreement between ranks on small Python objects; one process needs none."""

    rank, world_size = 0, 1
    dcp_kwargs: dict[str, Any] = {"no_dist": True}

    def broadcast(self, obj: Any, *, what: str) -> Any:
        return obj

    def all_gather(self, obj: Any, *, what: str) -> list[Any]:
        return [obj]


class GroupComm(Comm):
    """Objects exchanged over a (gloo) process group whose timeout bounds every wait."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.dcp_kwargs = {"process_group": group}

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo reports timeouts and dead peers as RuntimeError
            raise CheckpointError(
                f"rank {self.rank}: waiting for all {self.world_size} ranks to {what} failed or timed out "
                f"(limit {self.timeout_s:.0f}s): {exc}"
            ) from exc

    def broadcast(self, obj: Any, *, what: str) -> Any:
        box = [obj]
        with self._guard(what):
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj: Any, *, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with self._guard(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out


@contextlib.contextmanager
def quiet_single_process(comm: Comm) -> Iterator[None]:
    """Hide DCP's notice that it runs in one process: that is what we asked for."""
    with warnings.catch_warnings():
        if not isinstance(comm, GroupComm):
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)
        yield
