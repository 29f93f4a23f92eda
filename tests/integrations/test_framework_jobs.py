"""A Trainer job and a Lightning job grown 1 -> 2 and shrunk 2 -> 1 by real hyperpodrun launchers.

Each worker (workers/*_job.py) logs the sample ids every rank trained per optimizer
step and rank 0's loss per step. The elastic run must train, step for step, the same
samples as a fixed-size run of the same script (one process, no launcher): no sample
skipped or repeated across the change of world size, none trained twice across the
restart; and its final loss must be within 1e-4 of the fixed-size run's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.cluster import wait_until
from support.launch import clean_env

pytestmark = pytest.mark.slow

MAX_STEPS = 150  # the hold ends at step 3; the target step comes a few dozen fast steps later
# Ranks hold at step 3 until their own launcher announced the event (lockstep does the rest), so the
# target step need not allow for propagation: keep it close.
RDZV_CONF = ("--rdzv-conf", "lease_ttl=2,tick=0.1,propagation=0.05")
WORKERS = Path(__file__).resolve().parent / "workers"
FRAMEWORKS = {"hf": "hf_job.py", "lightning": "lightning_job.py"}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _samples_per_step(run_dir: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """step -> [(world size, ids) for every rank that logged it]."""
    out: dict[int, list[tuple[int, list[int]]]] = {}
    for path in sorted(run_dir.glob("samples-*.jsonl")):
        for rec in _read(path):
            out.setdefault(rec["step"], []).append((rec["world"], rec["ids"]))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fixed-size run of a framework's job (one process, no launcher), made once per module."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"ref-{name}")
            proc = subprocess.run(
                [sys.executable, str(WORKERS / FRAMEWORKS[name]), str(run_dir), str(MAX_STEPS)],
                capture_output=True, text=True, timeout=300, env=clean_env(),
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[name] = run_dir
        return runs[name]

    return get


def _assert_same_training(run_dir: Path, ref_dir: Path, worlds: list[int]) -> None:
    got, want = _samples_per_step(run_dir), _samples_per_step(ref_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1)), "a step is missing or was trained twice"
    for step in range(1, MAX_STEPS + 1):
        ranks = got[step]
        world = ranks[0][0]
        assert len(ranks) == world, f"step {step}: {len(ranks)} ranks logged it at world size {world}"
        ids = sorted(i for _, rank_ids in ranks for i in rank_ids)
        assert ids == want[step][0][1], f"step {step} at world size {world} trained other samples than the fixed run"
    phases = [got[s][0][0] for s in range(1, MAX_STEPS + 1)]
    assert [w for i, w in enumerate(phases) if i == 0 or phases[i - 1] != w] == worlds
    loss, ref_loss = _read(run_dir / "loss.jsonl"), _read(ref_dir / "loss.jsonl")
    assert loss[-1]["step"] == ref_loss[-1]["step"] == MAX_STEPS
    assert abs(loss[-1]["loss"] - ref_loss[-1]["loss"]) < 1e-4, (loss[-1], ref_loss[-1])


def _held(run_dir: Path, world: int) -> bool:
    return len(list(run_dir.glob("held-*"))) == world


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_grow_one_to_two(framework, make_job, reference, tmp_path) -> None:
    job = make_job(
        nnodes="1:2", flags=RDZV_CONF, script=WORKERS / FRAMEWORKS[framework], script_args=(str(tmp_path), str(MAX_STEPS))
    )
    job.start_node("a")
    wait_until(lambda: _held(tmp_path, 1), timeout=120, what="the first round to hold at step 3")
    job.start_node("b")  # a joining node: the launchers decide to grow, the ranks save and restart at 2
    codes = {n: p.wait(timeout=240) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a")[-3000:] + job.stderr("b")[-3000:]
    _assert_same_training(tmp_path, reference(framework), worlds=[1, 2])
    restarted = [e for e in job.events("workers_started") if e["world_size"] == 2]
    assert restarted and restarted[0]["reason"] == "scale"
    assert [e["world_size"] for e in job.events("checkpoint_loaded")] == [2]


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_shrink_two_to_one(framework, make_job, reference, tmp_path) -> None:
    job = make_job(
        nnodes="1:2", flags=(*RDZV_CONF, "--scaling-timeout", "10"),
        script=WORKERS / FRAMEWORKS[framework], script_args=(str(tmp_path), str(MAX_STEPS)),
    )  # fmt: skip
    job.start_node("a")
    job.start_node("b")
    wait_until(lambda: _held(tmp_path, 2), timeout=120, what="both ranks of the first round to hold at step 3")
    job.signal("b", signal.SIGTERM)  # preemption of node b: it leaves at the agreed step
    codes = {n: p.wait(timeout=240) for n, p in job.nodes.items()}
    assert codes == {"a": 0, "b": 0}, job.stderr("a")[-3000:] + job.stderr("b")[-3000:]
    _assert_same_training(tmp_path, reference(framework), worlds=[2, 1])
    assert [e["world_size"] for e in job.events("checkpoint_loaded")] == [1]
