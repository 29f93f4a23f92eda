"""In-memory snapshots of sharded models: the ring, the restore plan (pure), and real gloo ranks replicating
an FSDP2 model's shards, put back together bitwise, and a rank dying in the middle of sending its copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_events.rounds.snapshot import Entry, Layout, Piece, holder_of, owner_held_by
from elastic_events.rounds.snapshot_restore import SnapshotReport, assemble, plan_restore
from support.launch import clean_env
from support.ports import free_port

WORKER = Path(__file__).resolve().parent / "workers" / "snapshot_check.py"
SRC = Path(__file__).resolve().parents[2] / "src"


# ------------------------------------------------------------------------------ the ring


@pytest.mark.parametrize(("world", "local"), [(2, 1), (3, 1), (8, 4), (4, 4), (6, 2)])
def test_every_rank_is_held_once_on_another_node_when_there_is_one(world: int, local: int) -> None:
    holders = [holder_of(r, world_size=world, local_world_size=local) for r in range(world)]
    assert sorted(holders) == list(range(world))  # a permutation: every rank holds exactly one other's copies
    for rank, holder in enumerate(holders):
        assert holder != rank
        assert owner_held_by(holder, world_size=world, local_world_size=local) == rank
        if world > local:
            assert holder // local != rank // local  # on another node: a node's loss leaves its copies alive


# ------------------------------------------------------------------------ the restore plan


def report(
    rank: int, live: int = -1, copies: tuple[tuple[int, int], ...] = (), *, round: int = 4, world: int = 2
) -> SnapshotReport:
    return SnapshotReport(round=round, world_size=world, rank=rank, live_step=live, replicas=copies)


def test_a_survivors_live_state_and_the_dead_ranks_copy_at_its_step() -> None:
    # rank 1 died; rank 0 (new rank 0) is at 10 and holds rank 1's copies of 9 and 10
    plan = plan_restore({0: report(0, 10, ((1, 9), (1, 10), (0, 9)))})
    assert plan is not None and plan.step == 10 and plan.furthest == 10
    assert plan.sources == ((0, True), (0, False))  # its own shard from its live state, rank 1's from the copy


def test_a_survivor_past_the_dead_ranks_newest_copy_rolls_back_with_its_own_copy() -> None:
    # the case the own copy exists for: rank 0's copies were held by rank 1, who died before its copy of 10 was complete
    plan = plan_restore({0: report(0, 10, ((1, 8), (1, 9), (0, 9)))})
    assert plan is not None and (plan.step, plan.furthest) == (9, 10)
    assert plan.sources == ((0, False), (0, False))


def test_no_common_step_means_no_plan() -> None:
    assert plan_restore({0: report(0, 10, ((1, 7), (1, 8), (0, 9)))}) is None
    assert plan_restore({}) is None


def test_a_newcomer_reports_nothing_and_three_survivors_pick_the_newest_step_all_have() -> None:
    reports = {
        0: report(0, 21, ((2, 20), (2, 21), (0, 20)), world=3),  # holds rank 2's (the ring on one rank per node)
        1: report(2, 21, ((1, 19), (1, 20), (2, 20)), world=3),  # rank 1 died at 21 before its copy of 21 was complete
        2: SnapshotReport(round=4, world_size=3, rank=-1, live_step=-1),  # its replacement: nothing
    }
    plan = plan_restore(reports)
    assert plan is not None and (plan.step, plan.furthest) == (20, 21)
    assert plan.sources == (
        (0, False),
        (1, False),
        (0, False),
    )  # each at 20 from the lowest new rank holding it (0: no move)


def test_reports_of_an_older_round_are_ignored() -> None:
    reports = {0: report(0, 5, ((1, 5),)), 1: report(1, 3, (), round=2)}
    plan = plan_restore(reports)
    assert plan is not None and plan.step == 5 and plan.round == 4


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_never_picks_a_step_some_shard_lacks(seed: int) -> None:
    import random

    rng = random.Random(seed)
    world = rng.randint(2, 5)
    have: dict[int, set[int]] = {r: set() for r in range(world)}
    reports = {}
    for new in range(rng.randint(1, world)):
        old = rng.choice([-1, *range(world)])
        live = rng.randint(5, 7) if old >= 0 else -1
        copies = tuple((rng.randrange(world), rng.randint(4, 7)) for _ in range(rng.randint(0, 3)))
        reports[new] = report(old, live, copies, world=world)
        if old >= 0:
            have[old].add(live)
        for owner, step in copies:
            have[owner].add(step)
    common = set.intersection(*have.values())
    plan = plan_restore(reports)
    assert (plan is None) == (not common)
    if plan is not None:
        assert plan.step == max(common)
        for owner, (source, live) in enumerate(plan.sources):
            r = reports[source]
            assert (r.rank == owner and r.live_step == plan.step) if live else (owner, plan.step) in r.replicas


# ------------------------------------------------------------------------------ assembly


def test_pieces_of_raw_bytes_and_of_live_tensors_assemble_into_the_full_tensors() -> None:
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    bias = torch.tensor([1.0, 2.0], dtype=torch.float64)
    entries = [
        Entry(("model", "w"), torch.float32, (7, 3), (4, 3), 0, 0),
        Entry(("model", "b"), torch.float64, (2,), (2,), None, 0),
        Entry(("optim", "w", "step"), torch.float32, (), (), None, 0),
    ]
    first = Piece(
        owner=0,
        round=1,
        world_size=2,
        step=3,
        layout=Layout(tuple(entries)),
        small={"step": 3},
        param_groups=[{"lr": 0.1, "params": ["w"]}],
        tensors=[full[:4], bias, torch.tensor(3.0)],
    )
    second_layout = Layout((Entry(("model", "w"), torch.float32, (7, 3), (3, 3), 0, 4), *entries[1:]))
    raw = torch.zeros(second_layout.nbytes, dtype=torch.uint8)  # a holder's slot: every entry aligned
    for view, t in zip(second_layout.views(raw), (full[4:].contiguous(), bias, torch.tensor(3.0))):
        view.copy_(t.reshape(-1).view(torch.uint8))
    second = Piece(
        owner=1,
        round=1,
        world_size=2,
        step=3,
        layout=second_layout,
        small={"step": 3},
        param_groups=first.param_groups,
        tensors=second_layout.views(raw),
    )
    model, optim, head = assemble(iter([first, second]))
    assert torch.equal(model["w"], full) and torch.equal(model["b"], bias) and model["b"].dtype == torch.float64
    assert optim == {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    assert head is first


# ------------------------------------------------------------------------ real gloo ranks


def run_ranks(world: int, local: int, mode: str) -> list[dict]:
    port = free_port()
    env = clean_env(PYTHONPATH=str(SRC))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(port), str(local), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        results.append((proc.returncode, lines[-1] if lines else None, err))
    return results


@pytest.mark.parametrize(("world", "local"), [(2, 1), (3, 1), (4, 2)])
def test_the_copies_peers_hold_put_the_sharded_state_back_together_bitwise(world: int, local: int) -> None:
    results = run_ranks(world, local, "ok")
    assert all(code == 0 and out is not None for code, out, _ in results), [err[-2000:] for _, _, err in results]
    outs = [out for _, out, _ in results]
    for out in outs:  # the owner's two newest copies, and its own newest
        assert out["holdings"] == sorted([[out["owner"], 2], [out["owner"], 3], [out["rank"], 3]]), out
        assert out["closed"] is True
        owner_bytes = next(o["state_bytes"] for o in outs if o["rank"] == out["owner"])
        assert (
            out["held_bytes"] == 2 * owner_bytes + out["state_bytes"]
        )  # 3 buffers of the local state: two copies, its own
    assert outs[0]["model_equal"] is True and outs[0]["optim_equal"] is True, outs[0]
    assert outs[0]["untouched_equal"] is True, "snapshotting changed the training (AdamW's step count)"
    assert outs[0]["reloaded_equal"] is True, "a fresh model loaded from each rank's own copy is not the live state"
    assert all(out["wrong_piece"] and "another rank's piece" in out["wrong_piece"] for out in outs), [
        o["wrong_piece"] for o in outs
    ]
    assert outs[0]["small"] == {"step": 3}


def test_a_rank_that_dies_sending_its_copy_leaves_its_previous_copy_and_no_step_is_committed() -> None:
    world = 3
    results = run_ranks(world, 1, "die")
    dead = results[-1]
    assert dead[0] == -9, dead[2][-2000:]  # SIGKILL, half-way through its copy of step 4
    for code, out, err in results[:-1]:
        assert code == 0 and out is not None, err[-2000:]
        assert out["step_committed"] is False and "did not complete" in out["error"], (
            out
        )  # the optimizer step never ran
        holdings = {tuple(h) for h in out["holdings_after"]}
        assert (out["rank"], 3) in holdings  # its own copy is still the one every rank has
        if out["owner"] == world - 1:  # the dead rank's holder: its copy of step 3 survived the torn one of step 4
            assert (world - 1, 3) in holdings and (world - 1, 4) not in holdings, holdings


def test_aborting_an_idle_round_ends_both_threads_at_once() -> None:
    """Found by the failures benchmark: a repair's teardown took 1 s more now and then. The receiver, failing
    on the shut-down sockets, drained the sender's queue to release waiters, and took the sentinel that
    ends the sender with it: the sender waited on its queue until abort() gave up joining it (1 s)."""
    results = run_ranks(3, 1, "abort")
    assert all(code == 0 and out is not None for code, out, _ in results), [err[-2000:] for _, _, err in results]
    for _, out, _ in results:  # six rounds each: the race lost about one abort in three
        assert not any(out["alive"]) and max(out["abort_s"]) < 0.9, out
