"""In-process scale events with real rank processes on gloo, driven through their control channels.

Each node is a :class:`~support.fake_agent.FakeNode` (one rank): it writes the control
channel as the agent would; the processes, their process groups and their state are
real. The events are published before the ranks reach the target step, so nothing
depends on timing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from elastic_events.control import RankPhase
from support.fake_agent import FakeNode, Round

WORKER = Path(__file__).resolve().parent / "workers" / "inproc_train.py"
EVENT_STEP = 4


@pytest.fixture
def nodes(tmp_path):
    made: list[FakeNode] = []

    def make(name: str) -> FakeNode:
        made.append(FakeNode(tmp_path, name))
        return made[-1]

    yield make
    for node in made:
        node.close()


def load(out: Path, tag: str, node: str) -> dict:
    return torch.load(out / f"{tag}-{node}-0.pt", weights_only=False)


def assert_equal_state(a: dict, b: dict, *, keys=("step", "extra", "sampler", "scheduler")) -> None:
    for key in keys:
        assert a[key] == b[key], key
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def assert_equal_optimizer(a: dict, b: dict) -> None:
    def groups(state: dict) -> list:  # a full-state round trip turns tuples (betas) into lists
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]

    assert groups(a) == groups(b)
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


def events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def cmd(out: Path, steps: int, *extra: str) -> list[str]:
    return [str(WORKER), "--out", str(out), "--steps", str(steps), *extra]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_parked_joiner_is_hydrated_from_peers_and_survivors_keep_running(tmp_path, nodes, fsdp) -> None:
    out = tmp_path / "out"
    out.mkdir()
    extra = ("--fsdp",) if fsdp else ()
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    r0, r1 = Round.new(0, world_size=2, nodes=2), Round.new(1, world_size=3, nodes=3)
    a.start(cmd(out, 9, *extra), round=r0, group_rank=0)
    b.start(cmd(out, 9, *extra), round=r0, group_rank=1)
    c.start(cmd(out, 9, *extra), round=None)
    for node, rank in ((a, 0), (b, 1), (c, 2)):
        node.reconfigure(target_step=EVENT_STEP, round=r1, group_rank=rank)
    for node in (a, b, c):
        node.wait_phase(RankPhase.READY, round=1)
    assert [n.wait() for n in (a, b, c)] == [[0], [0], [0]], "\n".join(n.output() for n in (a, b, c))

    start = {n: load(out, "start", n) for n in "ab"}
    after = {n: load(out, "after", n) for n in "abc"}
    end = {n: load(out, "end", n) for n in "abc"}
    survivors_pids = [a.procs[0].pid, b.procs[0].pid]
    assert [start[n]["pid"] for n in "ab"] == [end[n]["pid"] for n in "ab"] == survivors_pids
    assert [after[n]["rank"] for n in "abc"] == [0, 1, 2] and {after[n]["world_size"] for n in "abc"} == {3}
    assert [after[n]["plan"] for n in "abc"] == [(0, 3), (1, 3), (2, 3)]
    assert after["a"]["step"] == EVENT_STEP and after["a"]["sampler"]["consumed"] == EVENT_STEP * 6
    for n in "bc":
        assert_equal_state(after["a"], after[n])
    if fsdp:
        before = load(out, "before", "a")  # gathered on the old 2-rank mesh
        assert_equal_optimizer(before["optimizer"], after["c"]["optimizer"])
        reference = before["params"]
        for name, full in reference.items():
            assert torch.equal(after["c"]["params"][name], full), name
            expected = torch.chunk(full, 3, dim=0)[2] if full.shape[0] > 2 else full.new_empty(0, *full.shape[1:])
            assert torch.equal(after["c"]["shards"][name], expected), f"{name}: rank 2 holds other rows"
    else:
        assert_equal_optimizer(after["a"]["optimizer"], after["c"]["optimizer"])
        for n in "bc":  # same gradients, same optimizer state: still one replica after more steps
            assert_equal_optimizer(end["a"]["optimizer"], end[n]["optimizer"])
    for n in "bc":
        assert_equal_state(end["a"], end[n])
    assert end["a"]["step"] == 9 and end["a"]["extra"]["samples"] == 9 * 6
    phases = [e["event"] for e in events(tmp_path) if e.get("source") == "trainer"]
    assert phases[phases.index("group_torn_down") :][:4] == ["group_torn_down", "group_up", "hydrated", "first_step"]


def test_a_leaving_node_exits_zero_and_survivors_reform_without_it(tmp_path, nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    r0, r1 = Round.new(0, world_size=3, nodes=3), Round.new(1, world_size=2, nodes=2)
    for rank, node in enumerate((a, b, c)):
        node.start(cmd(out, 8), round=r0, group_rank=rank)
    for node, rank in ((a, 1), (b, -1), (c, 0)):  # rank 0 of the new round is a survivor, not old rank 0
        node.reconfigure(target_step=EVENT_STEP, round=r1, group_rank=rank)
    assert [n.wait() for n in (a, b, c)] == [[0], [0], [0]], "\n".join(n.output() for n in (a, b, c))
    assert b.progress()[0].phase is RankPhase.LEAVING and f"left at step {EVENT_STEP}" in b.output()
    after = {n: load(out, "after", n) for n in "ac"}
    end = {n: load(out, "end", n) for n in "ac"}
    assert [after[n]["rank"] for n in "ac"] == [1, 0] and after["a"]["world_size"] == 2
    assert [end[n]["pid"] for n in "ac"] == [a.procs[0].pid, c.procs[0].pid]
    assert_equal_state(end["a"], end["c"])
    assert_equal_optimizer(end["a"]["optimizer"], end["c"]["optimizer"])
    assert end["a"]["step"] == 8 and end["a"]["sampler"]["consumed"] == 8 * 6


def test_a_joiner_counts_steps_with_its_peers_and_later_leaves_in_place(tmp_path, nodes) -> None:
    """1 -> 2 -> 1: the joiner adopts the job's step count, so the next event fires on both at once,
    and the run ends on the parameters of a fixed-size run (same samples in every step)."""
    out, gate, ckpt = tmp_path / "out", tmp_path / "gate", tmp_path / "ckpt"
    out.mkdir(), gate.mkdir()
    a, b = nodes("a"), nodes("b")
    r0, r1, r2 = (Round.new(n, world_size=w, nodes=w) for n, w in ((0, 1), (1, 2), (2, 1)))
    flags = ("--gate", str(gate), "--ckpt-dir", str(ckpt), "--ckpt-every", "2")  # saves in every round
    a.start(cmd(out, 9, *flags), round=r0, group_rank=0)
    b.start(cmd(out, 9, *flags), round=None)
    for node, rank in ((a, 0), (b, 1)):
        node.reconfigure(target_step=3, round=r1, group_rank=rank)
    for node in (a, b):
        node.wait_phase(RankPhase.READY, round=1)  # both hold at the gate: no step of round 1 yet
    assert [p.step for p in a.progress() + b.progress()] == [3, 3]
    for node, rank in ((a, 0), (b, -1)):
        node.reconfigure(target_step=6, round=r2, group_rank=rank)
    (gate / "go-1").touch()
    (gate / "go-2").touch()
    assert [n.wait() for n in (a, b)] == [[0], [0]], "\n".join(n.output() for n in (a, b))
    assert "left at step 6" in b.output()
    end = load(out, "end", "a")
    assert (end["pid"], end["world_size"], end["round"], end["step"]) == (a.procs[0].pid, 1, 2, 9)
    assert end["sampler"]["consumed"] == 9 * 6 and a.progress()[0].step == 9
    saved = [
        (int(p.name[5:]), json.loads((p / "COMPLETE").read_text())["world_size"]) for p in sorted(ckpt.glob("step_*"))
    ]
    assert saved == [(2, 1), (4, 2), (8, 1)]  # the checkpointer follows the group through both rounds
    fixed = nodes("fixed")  # the same 9 steps at a fixed world size of 1
    fixed.start(cmd(out, 9), round=Round.new(0, world_size=1, nodes=1), group_rank=0)
    assert fixed.wait() == [0], fixed.output()
    reference = load(out, "end", "fixed")["params"]
    for name, value in reference.items():
        torch.testing.assert_close(end["params"][name], value, rtol=0, atol=1e-5, msg=name)


def test_an_admitted_joiner_whose_round_never_forms_fails_with_one_clear_error(tmp_path, nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    c = nodes("c")
    c.start(cmd(out, 8, "--timeout", "2"), round=None)
    c.reconfigure(target_step=EVENT_STEP, round=Round.new(1, world_size=2, nodes=2), group_rank=1)
    assert c.wait()[0] != 0
    assert "GroupError: rank 1: forming round 1's group of 2 ranks at 127.0.0.1:" in c.output()
    assert "failed or timed out (limit 2s)" in c.output()
    assert c.progress()[0].phase is RankPhase.FAILED and c.progress()[0].acked_event == 1


def test_survivors_at_different_steps_refuse_to_train(tmp_path, nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    a, b = nodes("a"), nodes("b")
    r0, r1 = Round.new(0, world_size=2, nodes=2), Round.new(1, world_size=2, nodes=2)
    a.start(cmd(out, 8), round=r0, group_rank=0)
    b.start(cmd(out, 8, "--skew-step-of-rank", "1"), round=r0, group_rank=1)
    for node, rank in ((a, 0), (b, 1)):
        node.reconfigure(target_step=EVENT_STEP, round=r1, group_rank=rank)
    codes = [n.wait()[0] for n in (a, b)]
    assert all(code != 0 for code in codes), codes
    for node in (a, b):
        assert (
            "StateMismatchError: survivors hold different steps (rank 0 at step 4, rank 1 at step 5)" in node.output()
        )
        assert node.progress()[0].phase is RankPhase.FAILED
    assert not list(out.glob("after-*")) and not list(out.glob("end-*"))


def test_a_restart_event_saves_through_the_checkpointer_and_the_restart_resumes(tmp_path, nodes) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    a, b = nodes("a"), nodes("b")
    r0 = Round.new(0, world_size=2, nodes=2)
    for rank, node in enumerate((a, b)):
        node.start(cmd(out, 8, "--ckpt-dir", str(ckpt)), round=r0, group_rank=rank)
        node.save_and_exit(target_step=EVENT_STEP, round=1, world_size=1)
    assert [n.wait() for n in (a, b)] == [[0], [0]], "\n".join(n.output() for n in (a, b))
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{EVENT_STEP:09d}"]
    assert not list(out.glob("end-*"))
    c = nodes("c")  # the restart path: a new process at the new size, resuming from storage
    c.start(cmd(out, 8, "--ckpt-dir", str(ckpt)), round=Round.new(1, world_size=1, nodes=1), group_rank=0)
    assert c.wait() == [0], c.output()
    start, end = load(out, "start", "c"), load(out, "end", "c")
    assert (start["step"], start["sampler"]["consumed"], start["extra"]["samples"]) == (EVENT_STEP, 24, 24)
    assert (end["step"], end["sampler"]["consumed"], end["world_size"]) == (8, 48, 1)


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_outside_hyperpodrun_no_event_arrives(tmp_path, launcher) -> None:
    import subprocess

    from support.launch import clean_env, torchrun_cmd

    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), HYPERPODRUN_NODE_ID="solo")
    if launcher == "python":
        env["LOCAL_RANK"] = "0"
        argv = [sys.executable, *cmd(out, 5)]
    else:
        argv = torchrun_cmd("--standalone", "--nproc-per-node", "2", *cmd(out, 5))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ends = [torch.load(p, weights_only=False) for p in sorted(out.glob("end-solo-*.pt"))]
    world = 1 if launcher == "python" else 2
    assert [(e["world_size"], e["step"], e["sampler"]["consumed"]) for e in ends] == [(world, 5, 30)] * world
    assert_equal_state(ends[0], ends[-1])
