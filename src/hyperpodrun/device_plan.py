"""GPUs for several simulated nodes on one host: each node its own devices, or all of them on the CPU.

A real node runs one launcher that owns every GPU of the node. The demo, the benchmarks and the tests
start several launchers on one host to stand for several nodes; each would otherwise see the same
GPUs and start its local rank 0 on ``cuda:0``, which NCCL refuses at the first collective of two
ranks. :class:`DevicePlan` gives node slot ``i`` of ``nproc`` ranks the GPUs ``i*nproc ..
(i+1)*nproc - 1`` (``CUDA_VISIBLE_DEVICES``) when the host has enough for every slot; otherwise it
hides the GPUs from every node (one backend for the whole job: gloo on the CPU) and says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DevicePlan"]


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    """Which GPUs each of ``slots`` simulated nodes of ``nproc`` ranks gets on this host."""

    slots: int
    nproc: int
    gpus: int  # GPUs visible to the tool

    def __post_init__(self) -> None:
        if self.slots < 1 or self.nproc < 1 or self.gpus < 0:
            raise ValueError(f"a device plan needs slots >= 1, nproc >= 1, gpus >= 0; got {self}")

    @classmethod
    def for_host(cls, *, slots: int, nproc: int, gpus: int | None = None) -> DevicePlan:
        return cls(slots=slots, nproc=nproc, gpus=_visible_gpus() if gpus is None else gpus)

    @property
    def on_gpus(self) -> bool:
        """Every slot has GPUs of its own."""
        return self.gpus >= self.slots * self.nproc

    def env(self, slot: int) -> dict[str, str]:
        """The environment additions of the launcher in ``slot`` (none on a host without GPUs)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside 0..{self.slots - 1}")
        if self.gpus == 0:
            return {}
        if not self.on_gpus:
            return {"CUDA_VISIBLE_DEVICES": ""}
        first = slot * self.nproc
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(first, first + self.nproc))}

    def note(self) -> str | None:
        """One line when the GPUs are not used (None when they are, or when there are none)."""
        if self.gpus == 0 or self.on_gpus:
            return None
        return (
            f"{self.gpus} GPU(s) on this host for {self.slots} simulated node(s) x {self.nproc} rank(s): "
            "one GPU per rank does not fit, every node trains on the CPU (gloo)"
        )
