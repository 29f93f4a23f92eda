"""The Slurm recipe itself (docs/slurm/hyperpodrun.sbatch and join.sbatch) on a real Slurm cluster.

Three logical nodes (tests/support/slurm.py); the recipe's sizes and paths are its variables (one
rank per node, the tiny model on CPU, a run directory per test); everything else is what a user
runs: sbatch, scancel --signal=TERM, scontrol, a higher-priority job. Each test asserts world sizes,
that steps are contiguous (rank 0 logs every step), that the survivors' ranks kept their pids
through graceful events, Slurm's job states and exit codes, and the checkpoints.

Two sessions of events, each on one cluster shared by the session (a job start costs ~15 s here):

* grow with join.sbatch, leave by ``scancel --signal=TERM``, preemption of a ``low``-partition join
  by an ``urgent`` job (the join leaves, is requeued and rejoins in place), whole-job stop;
* node down by ``scontrol`` (repaired in place), a second one (below --nnodes MIN: the survivor
  saves and holds the state), refill by join.sbatch from memory, whole-job stop, resubmission that
  resumes from the checkpoint and stops with a save at the time-limit notice (``--signal``).
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.cluster import wait_until
from support.jsonl import read_jsonl
from support.slurm import GRACE_TIME, KILL_WAIT, SlurmCluster, SlurmError

REPO = Path(__file__).resolve().parents[2]
HYPERPODRUN_SBATCH = REPO / "docs" / "slurm" / "hyperpodrun.sbatch"
JOIN_SBATCH = REPO / "docs" / "slurm" / "join.sbatch"
TRAIN = REPO / "examples" / "llama_finetune" / "train.py"
# A step every ~0.1 s (sleeps, not CPU: other tests share the two cores); one data-loader worker per
# rank, which must outlive Slurm's SIGTERM like its rank.
TRAIN_ARGS = (
    "--model tiny --seq-len 32 --global-batch 4 --micro-batch 2 --num-workers 1 --steps 100000 "
    "--min-step-time 0.1 --log-every 1"
)
SUCCESS = {"JobState": "COMPLETED", "ExitCode": "0:0"}


class Recipe:
    """The recipe's jobs sharing one run directory, and what they leave there."""

    def __init__(self, slurm: SlurmCluster, tmp: Path, data_cache: Path) -> None:
        self.slurm = slurm
        self.dir = tmp / "run"
        self.dir.mkdir()
        self.env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the venv, as if activated
            "TRAIN": str(TRAIN),
            "TRAIN_ARGS": f"{TRAIN_ARGS} --data-cache {data_cache} --metrics {self.dir / 'metrics.jsonl'} "
            f"--sample-log {self.dir / 'samples.jsonl'}",
            "NPROC": "1",
            "NNODES": "2:3",
            "RUN_DIR": str(self.dir),
            "CKPT_EVERY": "0",  # checkpoints only where the events save: each one is asserted
            "SCALING_TIMEOUT": "2",
            "MIN_STABLE_PERIOD": "2",
            "GRACEFUL_TIMEOUT": "60",
            "OMP_NUM_THREADS": "1",
        }
        self.etcd = self.rdzv_id = ""
        self.jobs: dict[str, Path] = {}  # job id -> the script it runs

    # -- jobs ----------------------------------------------------------------------------

    def start(self, *, nodes: int, options: tuple[str, ...] = ()) -> str:
        """Submit hyperpodrun.sbatch; its job id once it printed where its etcd is."""
        job = self._submit(HYPERPODRUN_SBATCH, nodes=nodes, options=options)
        line = wait_until(
            lambda: re.search(r"ETCD=(\S+) JOB_ID=(\S+)", self.output(job)), timeout=90, what=f"job {job}: etcd"
        )
        self.etcd, self.rdzv_id = line.group(1), line.group(2)
        return job

    def join(self, *, nodes: int, options: tuple[str, ...] = ()) -> str:
        return self._submit(JOIN_SBATCH, nodes=nodes, options=options, ETCD=self.etcd, JOB_ID=self.rdzv_id)

    def _submit(self, script: Path, *, nodes: int, options: tuple[str, ...], **env: str) -> str:
        job = self.slurm.sbatch(
            script,
            nodes=nodes,
            env={**self.env, **env},
            output=self.dir / f"{script.stem}-%j.out",
            cwd=self.dir,
            options=options,
        )
        self.jobs[job] = script
        return job

    def track(self, job: str) -> str:
        """A job of the test that is not the recipe's (cancelled at the end if still there)."""
        self.jobs[job] = Path("other.sbatch")
        return job

    def output(self, job: str) -> str:
        path = self.dir / f"{self.jobs[job].stem}-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def stopped(self, *jobs: str, timeout: float = 90) -> list[dict[str, str]]:
        """Wait for the jobs to end; their scontrol fields."""
        return [self.slurm.wait_for(j, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", timeout=timeout) for j in jobs]

    # -- what the jobs left --------------------------------------------------------------

    def metrics(self) -> list[dict[str, Any]]:
        """Rank 0's record of each step (with its time); a rank 0 lost mid-step leaves that step out."""
        return read_jsonl(self.dir / "metrics.jsonl")

    def samples(self) -> list[dict[str, Any]]:
        """Every rank's record of every step it committed (step, rank, world size, sample ids)."""
        return read_jsonl(self.dir / "samples.jsonl")

    def steps(self) -> list[int]:
        """The steps some rank committed, in order."""
        return sorted({r["step"] for r in self.samples()})

    def worlds(self) -> list[int]:
        """The world sizes the job trained at, in order (one entry per stretch of steps)."""
        world = {r["step"]: r["world_size"] for r in self.samples()}
        return [w for w, _ in itertools.groupby(world[s] for s in sorted(world))]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.dir / "events.jsonl") if e["event"] == name]

    def agents(self) -> set[str]:
        return {e["node"] for e in self.events("agent_started")}

    def checkpoints(self) -> list[int]:
        folder = self.dir / "checkpoints"
        return sorted(int(p.name.removeprefix("step_")) for p in folder.glob("step_*")) if folder.exists() else []

    def wait_world(self, size: int, *, steps: int = 3, after: int = 0, timeout: float = 120) -> int:
        """Wait until ``steps`` steps after step ``after`` were trained at world ``size`` since the last change;
        the last step."""

        def trained() -> int:
            world = {r["step"]: r["world_size"] for r in self.samples()}
            tail = list(itertools.takewhile(lambda s: s > after and world[s] == size, sorted(world, reverse=True)))
            return tail[0] if len(tail) >= steps else 0

        return wait_until(trained, timeout=timeout, what=f"{steps} steps at world {size} (worlds {self.worlds()})")

    def lost_seconds(self, before: int, after: int, *, nth: int = 0) -> float:
        """Training time the ``nth`` change from world ``before`` to ``after`` cost: the gap between the last step
        at ``before`` and the first at ``after`` (rank 0's clock), less one ordinary step at ``after``."""
        records = self.metrics()
        changes = [
            (a, b) for a, b in zip(records, records[1:]) if (a["world_size"], b["world_size"]) == (before, after)
        ]
        if len(changes) <= nth:
            raise AssertionError(f"no change {nth + 1} from world {before} to {after} in {self.worlds()}")
        usual = statistics.median(
            y["ts"] - x["ts"] for x, y in zip(records, records[1:]) if x["world_size"] == y["world_size"] == after
        )
        a, b = changes[nth]
        return b["ts"] - a["ts"] - usual

    def figure(self, what: str, seconds: float) -> None:
        """A measured cost, printed for docs/slurm.md (pytest -s shows them)."""
        print(f"figure: {what}: {seconds:.2f} s", flush=True)

    def workers_started(self, node: str) -> int:
        return sum(e["node"] == node for e in self.events("workers_started"))

    def assert_contiguous(self) -> list[int]:
        """Every step from 1 on was committed, and no rank committed one twice (nothing redone); the steps."""
        steps = self.steps()
        assert steps == list(range(1, len(steps) + 1)), f"steps not contiguous: {_gaps(steps)}"
        counts = collections.Counter((r["step"], r["rank"]) for r in self.samples())
        assert max(counts.values()) == 1, f"steps redone: {[k for k, n in counts.items() if n > 1][:10]}"
        return steps


def _gaps(steps: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1][:10]


def _fields(job: dict[str, str]) -> dict[str, str]:
    return {k: job.get(k, "") for k in SUCCESS}


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenised corpus, shared by every job of the session."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def run(slurm: SlurmCluster, tmp_path: Path, data_cache: Path) -> Iterator[Recipe]:
    """The test's jobs; whatever is left of them at the end is cancelled, so the next test has the nodes."""
    recipe = Recipe(slurm, tmp_path, data_cache)
    yield recipe
    left = [j for j in recipe.jobs if j in slurm.squeue()]
    if left:
        slurm.scancel(*left)
        wait_until(lambda: not set(left) & set(slurm.squeue()), timeout=KILL_WAIT + 30, what=f"jobs {left} to end")


@pytest.mark.timeout(600)
def test_join_leave_preemption_requeue_and_stop(slurm: SlurmCluster, run: Recipe, tmp_path: Path) -> None:
    main = run.start(nodes=2)
    run.wait_world(2)
    originals = run.agents()
    assert len(originals) == 2

    # Grow with join.sbatch, then shrink by scancel --signal=TERM of that job: it leaves in place.
    t0 = time.monotonic()
    join = run.join(nodes=1)
    run.wait_world(3, steps=1)
    run.figure("join.sbatch submitted -> first step at world 3", time.monotonic() - t0)
    run.wait_world(3)
    run.figure("training lost to the join", run.lost_seconds(2, 3))
    t0 = time.monotonic()
    slurm.scancel(join, sig=signal.SIGTERM)
    (left,) = run.stopped(join)
    run.figure("scancel --signal=TERM of the join -> its job COMPLETED", time.monotonic() - t0)
    assert _fields(left) == SUCCESS, left
    run.wait_world(2)
    lost = run.lost_seconds(3, 2)
    run.figure("training lost to the leave", lost)
    assert lost <= 2.0, f"the leave cost {lost:.2f}s of training (target: 2 s)"

    # A join in the preemptible partition, preempted by an urgent job on its node: it leaves gracefully,
    # the recipe requeues it (PreemptMode=REQUEUE), and it rejoins in place once its node is free.
    low = run.join(nodes=1, options=("--partition=low",))
    run.wait_world(3)
    node = slurm.job(low)["NodeList"]
    t0 = time.monotonic()
    urgent = run.track(
        slurm.command(
            "sbatch",
            "--parsable",
            "--partition=urgent",
            f"--nodelist={node}",
            f"--output={tmp_path}/urgent-%j.out",
            "--wrap",
            "sleep 3",
        ).strip()
    )
    requeued = slurm.wait_for(low, "PENDING", timeout=GRACE_TIME + 30)
    run.figure("urgent job submitted -> preempted join left and requeued", time.monotonic() - t0)
    assert requeued["Restarts"] == "1", requeued
    assert "preempted: requeueing job" in run.output(low)
    run.wait_world(2)
    run.figure("training lost to the preempted leave", run.lost_seconds(3, 2, nth=1))
    assert _fields(slurm.wait_for(urgent, "COMPLETED", "FAILED", timeout=60)) == SUCCESS
    t0 = time.monotonic()
    slurm.command("scontrol", "update", f"JobId={low}", "StartTime=now")  # Slurm holds a requeued job 2 min
    slurm.wait_for(low, "RUNNING", timeout=60)
    run.wait_world(3, steps=1)
    run.figure("requeued join released -> first step at world 3 again", time.monotonic() - t0)
    run.wait_world(3)

    # Whole-job stop: every launcher exits 0 after a checkpoint at the last trained step.
    t0 = time.monotonic()
    slurm.scancel(main, low, sig=signal.SIGTERM)
    for job in run.stopped(main, low):
        assert _fields(job) == SUCCESS, job
    run.figure("scancel --signal=TERM of every job -> all COMPLETED, checkpoint written", time.monotonic() - t0)
    steps = run.assert_contiguous()
    # the stop of both jobs: the join's node may leave a step before the main job's stop is agreed (one step at 2)
    assert run.worlds() in ([2, 3, 2, 3, 2, 3], [2, 3, 2, 3, 2, 3, 2]), run.worlds()
    assert run.checkpoints() == [steps[-1]]
    assert not run.events("worker_failed"), "a rank died of a graceful event"
    for node_id in originals:  # the first allocation's ranks kept their processes through every event
        assert run.workers_started(node_id) == 1, node_id
    assert "left the job gracefully" in run.output(join)


@pytest.mark.timeout(600)
def test_node_down_hold_refill_resubmit_and_time_limit(slurm: SlurmCluster, run: Recipe) -> None:
    main = run.start(nodes=3)
    run.wait_world(3)
    originals = run.agents()
    nodes = slurm.command("scontrol", "show", "hostnames", slurm.job(main)["NodeList"]).split()  # etcd on the first

    # A node taken down by the admin: the job goes on at world 2, repaired in place.
    slurm.command("scontrol", "update", f"NodeName={nodes[2]}", "State=DOWN", "Reason=test")
    run.wait_world(2)
    run.figure("training lost to scontrol down of a member (repaired in place)", run.lost_seconds(3, 2))
    # A second one: one node is below --nnodes 2:3; the survivor saves and holds the state in memory.
    slurm.command("scontrol", "update", f"NodeName={nodes[1]}", "State=DOWN", "Reason=test")
    t0 = time.monotonic()
    held = wait_until(
        lambda: re.search(r"holding step (\d+) in memory; checkpoint of step \1 in (\S+);", run.output(main)),
        timeout=90,
        what="the survivor's hold",
    )
    held_step = int(held.group(1))
    run.figure("scontrol down below MIN -> the survivor saved and holds the state", time.monotonic() - t0)
    assert held.group(2) == str(run.dir / "checkpoints")
    assert run.checkpoints() == [held_step]
    assert run.steps()[-1] == held_step
    for n in nodes[1:]:
        try:
            slurm.command("scontrol", "update", f"NodeName={n}", "State=RESUME")
        except SlurmError:
            pass  # already back (ReturnToService=2)

    # A node that joins is hydrated from the survivor's memory: training resumes at the held step.
    t0 = time.monotonic()
    join = run.join(nodes=1)
    run.wait_world(2, after=held_step, steps=1)
    run.figure(
        "join.sbatch submitted to a held job -> first step at world 2, at the held step + 1", time.monotonic() - t0
    )
    run.wait_world(2, after=held_step)
    run.assert_contiguous()

    slurm.scancel(main, join, sig=signal.SIGTERM)
    for job in run.stopped(main, join):
        assert _fields(job) == SUCCESS, job
    steps = run.assert_contiguous()
    assert run.worlds() == [3, 2], run.worlds()  # no step is trained while the state is held
    assert run.checkpoints()[-1] == steps[-1]
    (survivor,) = [n for n in originals if n in {e["node"] for e in run.events("agent_stopped")}]
    assert run.workers_started(survivor) == 1  # the survivor's rank kept its process through repair and hold

    # Resubmission resumes from the checkpoint; the time-limit notice (--signal) stops it with a save.
    last = steps[-1]
    t0 = time.monotonic()
    again = run.start(nodes=2, options=("--time=10", "--signal=TERM@100"))
    run.wait_world(2, after=last, steps=1)
    run.figure("resubmitted job -> first step, resumed from the checkpoint", time.monotonic() - t0)
    run.wait_world(2, after=last)
    assert re.search(rf"resumed at step {last} from checkpoint", run.output(again)), run.output(again)[-3000:]
    slurm.command("scontrol", "update", f"JobId={again}", "TimeLimit=2")  # the notice comes at the next check
    t0 = time.monotonic()
    (done,) = run.stopped(again, timeout=120)
    run.figure("time limit moved within the --signal lead time -> job COMPLETED with a save", time.monotonic() - t0)
    assert _fields(done) == SUCCESS, done
    steps = run.assert_contiguous()
    assert run.checkpoints()[-1] == steps[-1] > last
