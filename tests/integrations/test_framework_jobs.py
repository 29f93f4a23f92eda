"""A Trainer job and a Lightning job grown 1 -> 2 and shrunk 2 -> 1 by real hyperpodrun launchers.

Each worker (workers/*_job.py) logs the sample ids and the process id of every rank per
optimizer step, and rank 0's loss per step. The elastic run must train, step for step, the
same samples as a fixed-size run of the framework's plain script (one process, no launcher): no
sample skipped or repeated across the change of world size, none trained twice; and its final
loss must be within 1e-4 of the fixed-size run's.

Two script structures, the same frameworks:

* ``in_place``: ``elastic_init()`` and ``ElasticTrainer`` / ``ElasticCallback.fit``. The
  ranks that stay keep their process (same pid before and after the event), newcomers
  receive the state from them, nothing is saved or loaded from storage.
* ``restart``: the plain framework ``Trainer`` with the callback (no ``elastic_init``).
  Every event saves the framework's checkpoint and the launcher restarts every rank.

``--restart-mode process`` turns an in-place script back to the restart path, with the
reason in the event log.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.cluster import wait_until
from support.finished import assert_finished_once, join_after_the_end
from support.jsonl import read_jsonl
from support.launch import clean_env

pytestmark = pytest.mark.slow

MAX_STEPS = 150  # the hold ends at step 8; the target step comes a few fast steps later
# Ranks hold at step 8 (workers/job_common.py: HOLD_AT, in the second epoch of 6 steps, so events land
# mid-epoch and the resume skips part of an epoch that is not the first) until their own launcher announced
# the event (lockstep does the rest), so the target step need not allow for propagation: keep it close.
RDZV_CONF = ("--rdzv-conf", "lease_ttl=2,tick=0.1,propagation=0.05")
WORKERS = Path(__file__).resolve().parent / "workers"
FRAMEWORKS = {"hf": "hf_job.py", "lightning": "lightning_job.py"}
MODES = ("in_place", "restart")
# One rank a node where a test's subject is not the node's size: a framework rank takes seconds of CPU to import
# and build (about 6 s each here), and the joins and leaves of two-rank nodes are the in-place grow-and-shrink
# cases' and the HSDP test's.
ONE_RANK = 1
CASES = [(framework, mode) for framework in sorted(FRAMEWORKS) for mode in MODES]


def _read(path: Path) -> list[dict]:
    return read_jsonl(path)


def _steps(run_dir: Path) -> dict[int, list[dict]]:
    """step -> the record of every rank that logged it ({"step", "world", "ids", "pid"})."""
    out: dict[int, list[dict]] = {}
    for path in sorted(run_dir.glob("samples-*.jsonl")):
        for rec in _read(path):
            out.setdefault(rec["step"], []).append(rec)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fixed-size run of a framework's plain job: the ``restart`` script (the framework's own Trainer with
    the callback), one process, no launcher; made once per module. Both modes' runs are compared with it, so an
    in-place run must train what the framework trains without elastic_events' rounds."""
    runs: dict[str, Path] = {}

    def get(framework: str) -> Path:
        if framework not in runs:
            run_dir = tmp_path_factory.mktemp(f"ref-{framework}")
            proc = subprocess.run(
                [sys.executable, str(WORKERS / FRAMEWORKS[framework]), str(run_dir), str(MAX_STEPS), "restart"],
                capture_output=True,
                text=True,
                timeout=300,
                env=clean_env(),
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[framework] = run_dir
        return runs[framework]

    return get


def _assert_same_training(run_dir: Path, ref_dir: Path, worlds: list[int]) -> dict[int, set[int]]:
    """The run trained what the fixed-size run trained, at ``worlds`` in turn; returns world size -> pids."""
    got, want = _steps(run_dir), _steps(ref_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1)), "a step is missing or was trained twice"
    pids: dict[int, set[int]] = {}
    for step in range(1, MAX_STEPS + 1):
        ranks = got[step]
        world = ranks[0]["world"]
        assert len(ranks) == world, f"step {step}: {len(ranks)} ranks logged it at world size {world}"
        ids = sorted(i for rec in ranks for i in rec["ids"])
        assert ids == want[step][0]["ids"], (
            f"step {step} at world size {world} trained other samples than the fixed run"
        )
        pids.setdefault(world, set()).update(rec["pid"] for rec in ranks)
    phases = [got[s][0]["world"] for s in range(1, MAX_STEPS + 1)]
    assert [w for i, w in enumerate(phases) if i == 0 or phases[i - 1] != w] == worlds
    loss, ref_loss = _read(run_dir / "loss.jsonl"), _read(ref_dir / "loss.jsonl")
    assert loss[-1]["step"] == ref_loss[-1]["step"] == MAX_STEPS
    assert abs(loss[-1]["loss"] - ref_loss[-1]["loss"]) < 1e-4, (loss[-1], ref_loss[-1])
    return pids


def _assert_event_path(
    job, run_dir: Path, mode: str, pids: dict[int, set[int]], *, newcomers: list[int], small: int = 1
) -> None:
    """In place: the ranks of the first node (``small`` of them) kept their processes across the events between
    worlds ``small`` and ``2 * small``, nothing went through storage, each event's round hydrated ``newcomers[i]``
    ranks. Restart: the opposite."""
    big = 2 * small
    kept = pids[small] & pids[big]
    saved = list(run_dir.glob("out/checkpoint-*")) + list(run_dir.glob("ckpt/elastic-step=*"))
    if mode == "in_place":
        assert len(kept) == small, (
            f"the surviving ranks should have kept their processes: pids at {small} ranks {pids[small]}, "
            f"at {big} {pids[big]}"
        )
        assert saved == [], f"an in-place event wrote checkpoints: {saved}"
        assert job.events("checkpoint_loaded") == []
        hydrated = job.events("hydrated")
        assert [e["newcomers"] for e in hydrated] == newcomers, hydrated
        assert job.events("in_place_unavailable") == []
    else:
        assert kept == set(), (
            f"the restart path restarted every rank: pids at {small} {pids[small]}, at {big} {pids[big]}"
        )
        assert saved, "the restart path saved no checkpoint"
        assert job.events("workers_reconfigured") == []


@pytest.mark.parametrize(("framework", "mode"), CASES)
def test_grow_one_to_two_then_shrink_back(framework, mode, make_job, reference, tmp_path) -> None:
    """Node b joins while node a's ranks hold at step 8; once every rank holds at step 80, b is preempted
    (SIGTERM) and leaves at the agreed step: nodes 1 -> 2 -> 1 in one job. In place the nodes run two ranks
    each (worlds 2 -> 4 -> 2: two newcomers hydrated, the accumulation planned anew at each size, both of a's
    ranks kept); the restart path, whose every rank restarts at each event, runs one."""
    per_node = 2 if mode == "in_place" else ONE_RANK
    (tmp_path / "shrink-later").touch()  # the ranks hold again at step 80 (workers/job_common.py)
    job = make_job(
        nnodes="1:2",
        flags=RDZV_CONF,
        script=WORKERS / FRAMEWORKS[framework],
        script_args=(str(tmp_path), str(MAX_STEPS), mode),
        nproc_per_node=per_node,
    )
    job.start_node("a")
    wait_until(
        lambda: len(list(tmp_path.glob("held-*"))) == per_node, timeout=180, what="the first round to hold at step 8"
    )
    job.start_node("b")  # a joining node: in place, its ranks are admitted and hydrated; else every rank restarts
    wait_until(
        lambda: len(list(tmp_path.glob("shrink-held-*"))) == 2 * per_node,
        timeout=180,
        what="every rank to hold at step 80",
    )
    job.signal("b", signal.SIGTERM)  # preemption of node b: it leaves at the agreed step
    codes = {n: p.wait(timeout=240) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a")[-3000:] + job.stderr("b")[-3000:]
    pids = _assert_same_training(tmp_path, reference(framework), worlds=[per_node, 2 * per_node, per_node])
    _assert_event_path(job, tmp_path, mode, pids, newcomers=[per_node, 0], small=per_node)
    if mode == "in_place":
        assert {e["world_size"] for e in job.events("workers_reconfigured")} == {2 * per_node, per_node}
    else:
        restarted = [e for e in job.events("workers_started") if e["world_size"] == 2]
        assert restarted and restarted[0]["reason"] == "scale"
        assert [e["world_size"] for e in job.events("checkpoint_loaded")] == [2, 1]
        assert [e["reason"] for e in job.events("in_place_unavailable")], "the restart path did not say why"


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_restart_mode_process_turns_an_in_place_script_to_the_restart_path(
    framework, make_job, reference, tmp_path
) -> None:
    job = make_job(
        nnodes="1:2",
        flags=(*RDZV_CONF, "--restart-mode", "process"),
        script=WORKERS / FRAMEWORKS[framework],
        script_args=(str(tmp_path), str(MAX_STEPS), "in_place"),
        nproc_per_node=ONE_RANK,
    )
    job.start_node("a")
    wait_until(lambda: len(list(tmp_path.glob("held-*"))) == 1, timeout=120, what="the first round to hold at step 8")
    job.start_node("b")
    codes = {n: p.wait(timeout=240) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a")[-3000:] + job.stderr("b")[-3000:]
    pids = _assert_same_training(tmp_path, reference(framework), worlds=[1, 2])
    _assert_event_path(job, tmp_path, "restart", pids, newcomers=[1])
    assert [e["world_size"] for e in job.events("checkpoint_loaded")] == [2]
    requested = job.events("restart_requested")
    assert len(requested) == 1 and "--restart-mode process" in requested[0]["reason"], requested
    assert "asked for a restart" in job.stderr("a")


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_finished_job_admits_no_joiner_and_an_abort_at_exit_is_success(framework, make_job, tmp_path) -> None:
    """The framework's callback says when training is over: a launcher that arrives after it is not admitted
    (the job is not trained again at 2 ranks), and the finished rank's abort at exit is not a failure."""
    (tmp_path / "linger").touch()  # the worker waits after training, then aborts (workers/job_common.py)
    steps = 6  # one epoch, ending before the hold at step 8
    job = make_job(
        nnodes="1:2",
        flags=RDZV_CONF,
        script=WORKERS / FRAMEWORKS[framework],
        script_args=(str(tmp_path), str(steps), "restart"),
        nproc_per_node=ONE_RANK,
    )
    join_after_the_end(job, tmp_path, finish_timeout=180)
    trained = _steps(tmp_path)
    assert sorted(trained) == list(range(1, steps + 1)), "a step is missing or was trained twice"
    assert {r["world"] for recs in trained.values() for r in recs} == {1}
    assert len({r["pid"] for recs in trained.values() for r in recs}) == 1  # never restarted
    assert_finished_once(job, steps=steps)


def test_lightning_hsdp_adds_then_removes_a_replica_on_the_restart_path(make_job, reference, tmp_path) -> None:
    """Lightning's ``ModelParallelStrategy`` with the model sharded over a node's 2 ranks and replicated across
    nodes (:func:`hsdp_mesh`): a node that joins adds a replica (mesh 1 x 2 -> 2 x 2); preempted once every rank
    holds at step 80, it removes it again (2 x 2 -> 1 x 2). The sharded checkpoint is saved and loaded at each
    new size, and the run trains what one process trains."""
    (tmp_path / "shrink-later").touch()  # the ranks hold again at step 80 (workers/job_common.py)
    job = make_job(
        nnodes="1:2",
        flags=RDZV_CONF,
        script=WORKERS / FRAMEWORKS["lightning"],
        script_args=(str(tmp_path), str(MAX_STEPS), "restart", "hsdp"),
        nproc_per_node=2,
    )
    job.start_node("a")
    wait_until(lambda: len(list(tmp_path.glob("held-*"))) == 2, timeout=180, what="2 ranks to hold at step 8")
    job.start_node("b")
    wait_until(lambda: len(list(tmp_path.glob("shrink-held-*"))) == 4, timeout=180, what="4 ranks to hold at step 80")
    job.signal("b", signal.SIGTERM)  # preemption of node b: it leaves at the agreed step
    codes = {n: p.wait(timeout=300) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a")[-3000:] + job.stderr("b")[-3000:]
    pids = _assert_same_training(tmp_path, reference("lightning"), worlds=[2, 4, 2])
    assert not pids[2] & pids[4] and len(pids[2]) == len(pids[4]) == 4, pids  # the restart path: new processes
    meshes = [(r["world"], tuple(r["shape"])) for path in tmp_path.glob("mesh-*.jsonl") for r in _read(path)]
    assert sorted(meshes) == sorted([(2, (1, 2))] * 4 + [(4, (2, 2))] * 4), meshes
    saved = sorted(tmp_path.glob("ckpt/elastic-step=*.ckpt"))
    assert len(saved) == 2 and all(p.is_dir() for p in saved), f"{saved}: one sharded checkpoint at each event"
    assert [e["world_size"] for e in job.events("checkpoint_loaded")] == [4, 2]
