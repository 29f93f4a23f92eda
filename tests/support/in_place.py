"""What the in-place tests share: the counter trainer on the in-process API, and checks of what it logs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from support.cluster import wait_until
from support.jsonl import read_jsonl

INPLACE = Path(__file__).resolve().parents[1] / "elastic" / "scripts" / "inplace_counter.py"
HYDRATED = ("peers", "handoff", "snapshot")  # how a newcomer got the state: from survivors, a hand-off, snapshots


def worlds(job) -> list[dict]:
    return read_jsonl(job.run_dir / "worlds.jsonl")


def reference_params(at_steps: set[int]) -> dict[int, list[list[float]]]:
    """What one process has trained after each of ``at_steps`` steps of the same data (DDP averages the same gradient)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    out = {}
    for step in range(max(at_steps)):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        (model(x) - y).square().sum().div(8).backward()
        opt.step()
        opt.zero_grad()
        if step + 1 in at_steps:
            out[step + 1] = [p.detach().flatten().tolist() for p in model.parameters()]
    return out


def script_args(model: str, run_dir: Path) -> tuple[str, ...]:
    """The counter script's arguments: its run dir (make_job's is the test's tmp_path), and ``fsdp`` to shard."""
    return (str(run_dir),) if model == "ddp" else (str(run_dir), model)


def pid_of_rank(job, rank: int, *, timeout: float = 60) -> int:
    """The pid of the newest process that recorded ``rank``'s world (waiting for the first such record). A
    process that left records rank 0 of a world of 1 (it has no group): its ``left`` record names no rank."""
    mine = wait_until(
        lambda: [r for r in worlds(job) if r["rank"] == rank and r["how"] != "left"],
        timeout=timeout,
        what=f"rank {rank}'s record",
    )
    return mine[-1]["pid"]


def rescued_ranks(job) -> list[int]:
    """Survivors replaced because they never returned from the broken group's collective (gloo, now and then,
    misses a dead peer even after the repair watch shut its sockets down: ``repair.stuck_in_broken_group``).
    Each handed its state off first, so its replacement continues from it: nothing is lost, nothing redone."""
    return [
        r
        for e in job.events("ranks_replaced")
        if "still blocked in the broken group" in e["reason"]
        for r in e["ranks"]
    ]


def rank_0_rescued(job, survivor: int) -> bool:
    """Whether rank 0 (pid ``survivor``) never returned from a broken collective and was replaced: at most
    once, and then its replacement took the state it handed off."""
    rescued = rescued_ranks(job)
    assert rescued in ([], [0]), rescued
    records = worlds(job)
    first_how: dict[int, str] = {}  # a replacement's first round; it may then survive a later failure
    for r in records:
        if r["rank"] == 0 and r["pid"] != survivor:
            first_how.setdefault(r["pid"], r["how"])
    assert list(first_how.values()) == ["handoff"] * len(rescued), records
    return bool(rescued)


def hit_rank_1(job, sig: int) -> tuple[int, int]:
    """``sig`` to rank 1 mid-training; returns (rank 0's pid, rank 1's) once the replacement trained a few steps."""
    job.wait_steps(5)
    survivor, victim = pid_of_rank(job, 0), pid_of_rank(job, 1)
    os.kill(victim, sig)
    wait_until(
        lambda: [r for r in worlds(job) if r["how"] in HYDRATED], timeout=60, what="the replacement rank to be hydrated"
    )
    job.wait_steps(5)
    return survivor, victim


def two_nodes_hit_rank_1(job, sig: int, *, start_timeout: float = 90) -> tuple[int, int]:
    """Nodes a and b started, ``sig`` to rank 1 once the round runs in process (:func:`hit_rank_1`), the job
    finished with both launchers exiting 0; returns (rank 0's pid, rank 1's)."""
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: job.events("round_in_process"), timeout=start_timeout, what="the round to run in-process")
    survivor, victim = hit_rank_1(job, sig)
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.stderr("a"), job.stderr("b"))
    return survivor, victim


def committed_steps(job) -> list[int]:
    """Rank 0's steps, each once, in order; a step is trained again only after a sharded model rolled back to
    its newest snapshot (``snapshot_restored``, at most the snapshot interval: 1 with a snapshot every step, or
    the interval ``--snapshot-every auto`` chose) or an HSDP step applied on some shard indices only was
    trained again from the copies one step back (``step_rolled_back``, 1 step), never otherwise.

    Rank 0 logs no step only where a repair gave it a peer's newer state: a rank killed mid all-reduce can
    leave one survivor a step ahead (it had every peer's share), and the repair resumes all from it; rank 0's
    ``recovered`` record is then at the step it did not log. A restart of every rank from nothing (rank 0 noted
    ``fresh`` again) starts the count over."""
    # auto (the default) times a round's first steps with a snapshot every other step: up to 2 steps redone then
    interval = max([2, *(e["every"] for e in job.events("snapshot_interval"))])
    assert all(e["redone"] <= interval for e in job.events("snapshot_restored")), job.events("snapshot_restored")
    assert all(e["redone"] == 1 for e in job.events("step_rolled_back")), job.events("step_rolled_back")
    progress = job.progress()

    def logged_past(event: dict) -> bool:
        """Rank 0 had logged a step past the one rolled back to: it trains that step again, visibly."""
        return max((p["step"] for p in progress if p["ts"] < event["ts"]), default=0) > event["step"]

    # An HSDP rollback where another rank was the one a step ahead redoes no step that rank 0 had logged.
    rollbacks = [
        e
        for e in job.events()
        if e["event"] in ("snapshot_restored", "step_rolled_back")
        and e["redone"]
        and (e["event"] == "snapshot_restored" or logged_past(e))
    ]
    adopted = {r["step"] for r in worlds(job) if r["rank"] == 0 and r["how"] == "recovered"}
    # Each start of rank 0 after the first that began from nothing (these scripts keep no checkpoint): a restart of
    # every rank, e.g. a node that registered after the first round had started and whose join took the restart path.
    restarts = sum(1 for r in worlds(job) if r["rank"] == 0 and r["how"] == "fresh") - 1
    steps: list[int] = []
    for step in (p["step"] for p in progress):
        if steps and step == 1 and restarts > 0:
            restarts -= 1
            steps = []  # the restarted job trains from step 1 again
        if steps and step == steps[-1] + 2 and step - 1 in adopted:
            steps.append(step - 1)  # committed by the peer rank 0 resumed from
        if steps and step <= steps[-1]:
            assert rollbacks, f"step {step} trained again after step {steps[-1]} without a snapshot restore"
            restored = rollbacks.pop(0)
            # redone counts from the newest live step, which a peer may have reached one step past rank 0's log
            behind = restored["step"] + restored["redone"] - steps[-1]
            assert step == restored["step"] + 1 and behind in (0, 1), (step, steps[-1], restored)
            del steps[restored["step"] :]
        steps.append(step)
    assert steps == list(range(1, len(steps) + 1)), steps  # nothing committed was lost
    assert not rollbacks, rollbacks
    return steps


def assert_trained_like_one_process(job) -> list[int]:
    """Every committed step once, in order, and every rank's final parameters those of an unbroken run; the steps."""
    steps = committed_steps(job)
    final = [json.loads(x) for x in (job.run_dir / "final.jsonl").read_text().splitlines()]
    assert final and {f["step"] for f in final} == {steps[-1]}, final
    reference = reference_params({steps[-1]})[steps[-1]]
    for f in final:
        for got, want in zip(f["params"], reference):
            assert got == pytest.approx(want, abs=1e-5)
    return steps


def assert_events_reconfigured_in_place(job, *, reconfigures: int) -> list[dict]:
    """The scale events ran in place: at least ``reconfigures`` reconfigure signals to a target step and none
    to save and exit, and every in-place round's members whole nodes; those rounds' ``rendezvous_done``."""
    signalled = [e["kind"] for e in job.events("workers_signalled") if e.get("target_step") is not None]
    assert signalled.count("reconfigure") >= reconfigures and "save_and_exit" not in signalled, signalled
    in_place = [e for e in job.events("rendezvous_done") if e.get("in_place")]
    assert in_place and all(len(e["members"]) == e["world_size"] / job.nproc_per_node for e in in_place), in_place
    return in_place


def ranks_of_node(job, name: str) -> dict[int, int]:
    """Node ``name``'s ranks now, global rank -> pid (from the ranks' own records)."""
    children = {p.pid for p in psutil.Process(job.nodes[name].pid).children(recursive=True)}
    latest: dict[int, int] = {}
    for r in worlds(job):
        latest[r["rank"]] = r["pid"]
    return {rank: pid for rank, pid in latest.items() if pid in children}
