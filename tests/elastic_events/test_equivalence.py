"""The headline guarantee: resizing the job does not change what it learns.

A small MLP (fp32, no dropout) trains 16 AdamW steps with a warm-up LR schedule and
a constant global batch of 10 samples (4 epochs of 40 shuffled samples). The elastic
run is four separate ``torch.distributed.run`` launches at world sizes 1 -> 3 -> 2 -> 1,
each loading the newest DCP checkpoint, training its steps and saving; the reference
is one launch at world size 1. Both runs use the same worker,
``workers/equiv_train.py``.

Tolerance: ``atol=1e-6`` (rtol 0) on parameters of magnitude <= 0.6; runs on this
machine differ by at most ~6e-8, i.e. one float32 ulp. It is not zero because the
global-batch gradient is summed in a different order at each world size
(micro-batches [4, 3, 3] accumulated in ``.grad`` on one rank versus per-rank partial
sums all-reduced by DDP, then scaled by W and averaged by 1/W), and float addition is
not associative. A single lost, repeated or misweighted sample, or a skipped
optimizer or scheduler state, moves the parameters by ~1e-2 (one step's update),
four orders of magnitude above the tolerance; the test checks that margin too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from support.launch import clean_env, run, torchrun_cmd

WORKER = Path(__file__).resolve().parent / "workers" / "equiv_train.py"
SRC = Path(__file__).resolve().parents[2] / "src"
SCHEDULE = ((1, 4), (3, 9), (2, 13), (1, 16))  # (world size, steps done at the end of the phase)
TOTAL_STEPS = SCHEDULE[-1][1]
NUM_SAMPLES, GLOBAL_BATCH = 40, 10  # equiv_train.NUM_SAMPLES, equiv_train.GLOBAL_BATCH
ATOL = 1e-6


def launch(world: int, until: int, root: Path) -> None:
    cmd = torchrun_cmd(
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(WORKER),
        "--ckpt-dir",
        str(root / "ckpt"),
        "--out",
        str(root),
        "--until",
        str(until),
    )
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = run(cmd, timeout=180, env=env)
    assert proc.returncode == 0, f"phase at world {world} until step {until} failed:\n{proc.stderr[-4000:]}"


def phase_reports(root: Path, world: int, until: int) -> list[dict]:
    return [json.loads((root / f"phase_{until}_rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    reference, elastic = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("elastic")
    launch(1, TOTAL_STEPS, reference)
    for world, until in SCHEDULE:
        launch(world, until, elastic)
    return reference, elastic


@pytest.mark.slow
def test_each_phase_resumed_from_the_previous_one(runs: tuple[Path, Path]) -> None:
    _, elastic = runs
    previous_world, previous_until = None, 0
    for world, until in SCHEDULE:
        for report in phase_reports(elastic, world, until):
            assert report["world"] == world
            assert report["loaded_step"] == previous_until
            assert report["loaded_from_world"] == previous_world
            assert [s["step"] for s in report["steps"]] == list(range(previous_until + 1, until + 1))
        previous_world, previous_until = world, until


@pytest.mark.slow
def test_every_step_trains_the_same_global_batch(runs: tuple[Path, Path]) -> None:
    reference, elastic = runs
    expected = {s["step"]: s for s in phase_reports(reference, 1, TOTAL_STEPS)[0]["steps"]}
    shares: dict[int, list[dict]] = {}  # step -> what each rank of that step's phase trained
    for world, until in SCHEDULE:
        for report in phase_reports(elastic, world, until):
            for entry in report["steps"]:
                shares.setdefault(entry["step"], []).append(entry)
    assert sorted(shares) == sorted(expected) == list(range(1, TOTAL_STEPS + 1))
    for step, entries in shares.items():
        union = [idx for entry in entries for idx in entry["samples"]]
        assert len(union) == len(set(union)) == GLOBAL_BATCH, f"step {step}: a sample trained twice or missing"
        assert sorted(union) == sorted(expected[step]["samples"]), f"step {step} trained another global batch"
        assert {entry["epoch"] for entry in entries} == {expected[step]["epoch"]}
    for epoch in range(TOTAL_STEPS * GLOBAL_BATCH // NUM_SAMPLES):
        seen = sorted(idx for s in expected.values() if s["epoch"] == epoch for idx in s["samples"])
        assert seen == list(range(NUM_SAMPLES)), f"epoch {epoch} did not see every sample exactly once"


@pytest.mark.slow
def test_resized_training_ends_with_the_same_parameters(runs: tuple[Path, Path]) -> None:
    reference, elastic = runs
    expected = torch.load(reference / f"params_{TOTAL_STEPS}.pt")
    actual = torch.load(elastic / f"params_{TOTAL_STEPS}.pt")
    for step in sorted(actual):  # the last phase's steps, including the final one
        torch.testing.assert_close(
            actual[step], expected[step], rtol=0, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}"
        )
    one_step = max(
        (expected[TOTAL_STEPS][k] - expected[TOTAL_STEPS - 1][k]).abs().max().item() for k in expected[TOTAL_STEPS]
    )
    assert one_step > 1000 * ATOL, f"one step moves parameters by only {one_step:.2e}: the tolerance proves nothing"
