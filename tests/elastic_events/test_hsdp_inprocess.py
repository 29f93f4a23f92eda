"""Elastic HSDP with real rank processes on gloo: nodes join and leave as whole replicas, in place.

Nodes of 2 ranks (:class:`~support.fake_agent.FakeNode`, the agent's side of the control channel),
HSDP shard groups of 2 (a node): 2 replicas grow to 3 (a parked node is admitted) and shrink to 2
again (the first node leaves, so the others are renumbered). Events are published before the ranks
reach their target steps: nothing depends on timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_events.control import RankPhase
from support.fake_agent import FakeNode, Round

WORKER = Path(__file__).resolve().parent / "workers" / "inproc_train.py"
STEPS, GLOBAL_BATCH, SAMPLES = 9, 6, 60
LIMIT_S = 180  # six ranks importing torch on a loaded 2-core machine take a minute to reach their first step


@pytest.fixture
def nodes(tmp_path):
    made: list[FakeNode] = []

    def make(name: str) -> FakeNode:
        made.append(FakeNode(tmp_path, name, nproc=2))
        return made[-1]

    yield make
    for node in made:
        node.close()


def dumps(out: Path, tag: str, node: str) -> list[dict]:
    return [torch.load(out / f"{tag}-{node}-{local}.pt", weights_only=False) for local in (0, 1)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_hsdp_nodes_join_and_leave_as_replicas_in_place(tmp_path, nodes) -> None:
    """2 x 2 -> 3 x 2 -> 2 x 2. The join sends one replica's shards (rank i of the new node from rank i of
    replica 0), the leave moves nothing; the survivors keep their processes, every step is trained once on
    a full global batch of distinct samples, and the run ends on the parameters of a fixed 2 x 2 HSDP run."""
    out, gate, ledger = tmp_path / "out", tmp_path / "gate", tmp_path / "ledger.jsonl"
    out.mkdir(), gate.mkdir()
    cmd = [str(WORKER), "--out", str(out), "--steps", str(STEPS), "--hsdp", "--fp64", "--gate", str(gate)]
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    r0, r1, r2 = (Round.new(n, world_size=2 * k, nodes=k) for n, k in ((0, 2), (1, 3), (2, 2)))
    a.start([*cmd, "--ledger", str(ledger)], round=r0, group_rank=0)
    b.start([*cmd, "--ledger", str(ledger)], round=r0, group_rank=1)
    c.start([*cmd, "--ledger", str(ledger)], round=None)
    for node, rank in ((a, 0), (b, 1), (c, 2)):
        node.reconfigure(target_step=3, round=r1, group_rank=rank)
    for node in (a, b, c):
        node.wait_phase(RankPhase.READY, round=1, timeout=LIMIT_S)  # each holds at the gate: no step of round 1 yet
    for node, rank in ((a, -1), (b, 0), (c, 1)):  # a leaves: b's ranks become 0-1, c's 2-3
        node.reconfigure(target_step=6, round=r2, group_rank=rank)
    (gate / "go-1").touch()
    (gate / "go-2").touch()
    assert [n.wait(LIMIT_S) for n in (a, b, c)] == [[0, 0]] * 3, "\n".join(n.output() for n in (a, b, c))
    assert a.output().count("left at step 6") == 2

    start = {n: dumps(out, "start", n) for n in "ab"}
    after = {n: dumps(out, "round1", n) for n in "abc"}  # a, b: after the join; c: admitted
    end = {n: dumps(out, "end", n) for n in "bc"}
    for n in "ab":  # the survivors never restarted
        assert [d["pid"] for d in start[n]] == [p.pid for p in dict(a=a, b=b)[n].procs]
    assert [d["pid"] for d in end["b"]] == [p.pid for p in b.procs] == [d["pid"] for d in start["b"]]
    assert [d["pid"] for d in end["c"]] == [p.pid for p in c.procs] == [d["pid"] for d in after["c"]]
    assert [d["rank"] for n in "abc" for d in after[n]] == [0, 1, 2, 3, 4, 5]
    assert [d["rank"] for n in "bc" for d in end[n]] == [0, 1, 2, 3]
    # the new replica holds replica 0's shards, shard index by shard index, and the same small state
    for local in (0, 1):
        source, joined = after["a"][local], after["c"][local]
        assert (joined["step"], joined["sampler"], joined["scheduler"]) == (3, source["sampler"], source["scheduler"])
        for name, shard in source["shards"].items():
            assert torch.equal(joined["shards"][name], shard), name
    assert (end["b"][0]["step"], end["b"][0]["sampler"]["consumed"]) == (STEPS, STEPS * GLOBAL_BATCH)

    events = read_jsonl(tmp_path / "events.jsonl")
    hydrated = [e for e in events if e["event"] == "hydrated"]
    replica_bytes = sum(d["state_bytes"] for d in after["a"])  # one replica: its two ranks' local state
    assert replica_bytes > 0
    assert [(e["round"], e["mesh"], e["newcomers"], e["bytes_moved"]) for e in hydrated] == [
        (1, [3, 2], 2, replica_bytes),
        (2, [2, 2], 0, 0),
    ]
    assert not [e for e in events if e["event"].startswith("snapshot")], "no snapshot copies while 2 replicas exist"

    # the step ledger: every step once, at its world size, a full global batch of samples never trained before
    records = read_jsonl(ledger)
    worlds = {r["step"]: r["world_size"] for r in records}
    assert worlds == {s: 4 if s <= 3 or s > 6 else 6 for s in range(1, STEPS + 1)}
    per_step: dict[int, list[int]] = {}
    for r in records:
        per_step.setdefault(r["step"], []).extend(r["samples"])
    assert all(len(per_step[s]) == GLOBAL_BATCH for s in per_step), per_step
    trained = [i for s in sorted(per_step) for i in per_step[s]]
    assert len(trained) == len(set(trained)) == STEPS * GLOBAL_BATCH

    f, g = nodes("f"), nodes("g")  # the same steps on a fixed 2 x 2 HSDP mesh
    fixed = Round.new(0, world_size=4, nodes=2)
    f.start(cmd[:-2], round=fixed, group_rank=0)
    g.start(cmd[:-2], round=fixed, group_rank=1)
    assert [n.wait(LIMIT_S) for n in (f, g)] == [[0, 0]] * 2, "\n".join(n.output() for n in (f, g))
    reference = dumps(out, "end", "f")[0]["params"]
    initial = dumps(out, "start", "a")[0]["params"]
    for name, value in reference.items():
        assert (value - initial[name]).abs().max() > 1e-3, f"{name} barely trained"
        for d in (*end["b"], *end["c"]):
            assert d["params"][name].dtype == torch.float64
            torch.testing.assert_close(d["params"][name], value, rtol=0, atol=1e-12, msg=name)
