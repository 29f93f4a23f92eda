"""Nodes driven the way a hyperpodrun agent drives them, without the launcher (tests only).

:class:`FakeNode` stands in for one agent only: it creates the node's control channel,
starts the node's rank processes with the environment an agent gives them (normal or
parked), publishes events and reads the ranks' slots. The rank processes, their gloo
groups and their state are real.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from elastic_events.control import ControlWriter, EventKind, RankPhase, RankProgress
from support.cluster import wait_until
from support.launch import clean_env
from support.ports import free_port

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass(frozen=True)
class Round:
    """A round as the agents agree on it: number, world size, node count and its store."""

    number: int
    world_size: int
    nodes: int
    master_port: int
    master_addr: str = "127.0.0.1"

    @classmethod
    def new(cls, number: int, *, world_size: int, nodes: int) -> Round:
        return cls(number, world_size, nodes, free_port())


class FakeNode:
    """One node: its control channel and its ranks (``nproc`` processes)."""

    def __init__(self, tmp: Path, name: str, *, nproc: int = 1) -> None:
        self.name, self.nproc, self.tmp = name, nproc, tmp
        self.channel = ControlWriter(tmp / f"{name}.ctl", nproc)
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []
        self._event_id = 0

    def start(
        self, cmd: list[str], *, round: Round | None, group_rank: int = -1, extra_env: dict[str, str] | None = None
    ) -> None:
        """Start the ranks; ``round=None`` starts them parked (a pre-warmed joiner)."""
        for local in range(self.nproc):
            env = clean_env(
                PYTHONPATH=str(SRC),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(self.nproc),
                HYPERPODRUN_CONTROL_FILE=str(self.channel.path),
                HYPERPODRUN_EVENT_LOG=str(self.tmp / "events.jsonl"),
                HYPERPODRUN_NODE_ID=self.name,
                TORCHELASTIC_USE_AGENT_STORE="False",
                **(extra_env or {}),
            )
            if round is None:
                env["HYPERPODRUN_PARKED"] = "1"
            else:
                rank = group_rank * self.nproc + local
                env.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(round.world_size),
                    GROUP_RANK=str(group_rank),
                    GROUP_WORLD_SIZE=str(round.nodes),
                    ROLE_RANK=str(rank),
                    ROLE_WORLD_SIZE=str(round.world_size),
                    MASTER_ADDR=round.master_addr,
                    MASTER_PORT=str(round.master_port),
                    HYPERPODRUN_ROUND=str(round.number),
                )
            log = self.tmp / f"{self.name}-{local}.log"
            self.logs.append(log)
            with log.open("w") as out:
                self.procs.append(
                    subprocess.Popen([sys.executable, *cmd], env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
                )

    def reconfigure(self, *, target_step: int, round: Round, group_rank: int) -> None:
        """Publish the RECONFIGURE event every agent of the job publishes for ``round``."""
        self._event_id += 1
        self.channel.publish(
            event_id=self._event_id,
            target_step=target_step,
            kind=EventKind.RECONFIGURE,
            round=round.number,
            world_size=round.world_size,
            group_rank=group_rank,
            group_world_size=round.nodes,
            master_addr=round.master_addr,
            master_port=round.master_port,
        )

    def save_and_exit(self, *, target_step: int, round: int, world_size: int) -> None:
        self._event_id += 1
        self.channel.publish(
            event_id=self._event_id,
            target_step=target_step,
            kind=EventKind.SAVE_AND_EXIT,
            round=round,
            world_size=world_size,
        )

    def progress(self) -> list[RankProgress]:
        return self.channel.progress()

    def wait_phase(self, phase: RankPhase, *, round: int, timeout: float = 60) -> None:
        wait_until(
            lambda: all(p.phase is phase and p.round == round for p in self.progress()),
            timeout=timeout,
            what=f"node {self.name}'s ranks in phase {phase.name} of round {round}",
            interval=0.01,
        )

    def wait(self, timeout: float = 60) -> list[int]:
        """The ranks' exit codes (raises TimeoutError naming the node if one does not exit)."""
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"node {self.name}'s rank {proc.pid} did not exit within {timeout}s") from None
        return codes

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.channel.close()
