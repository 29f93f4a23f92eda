"""Exactly-once data over real world-size changes: 2 -> 3 -> 1 ranks, gloo, prefetching loaders."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

import elastic_events
from elastic_events.data.dataset import ByteTokenizer, build_token_dataset
from elastic_events.data.sampler import epoch_permutation
from support.launch import clean_env, torchrun_cmd

WORKER = Path(__file__).resolve().parent / "elastic_data_worker.py"
SRC = Path(elastic_events.__file__).resolve().parents[1]

GLOBAL_BATCH, MICRO_BATCH, SEED, SEQ_LEN = 7, 2, 11, 8
# (world size, steps); the last phase runs to the end of the epoch.
PHASES = [(2, 3), (3, 2), (1, -1)]


def launch(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    cmd = torchrun_cmd("--standalone", f"--nproc-per-node={nproc}", str(WORKER), *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_world_size_changes_train_every_sample_exactly_once(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"document {i:03d} " + "xyz" * (i % 5) for i in range(40)), encoding="utf-8")
    dataset = build_token_dataset([text], tmp_path / "data", ByteTokenizer(), seq_len=SEQ_LEN)
    n = len(dataset)
    assert n % GLOBAL_BATCH != 0, "the epoch must have a dropped tail"

    state = None
    for phase, (world, steps) in enumerate(PHASES):
        ledger = tmp_path / f"ledger{phase}"
        ledger.mkdir()
        state_out = tmp_path / f"state{phase}.pt"
        args = [
            f"--data={tmp_path / 'data'}",
            f"--state-out={state_out}",
            f"--ledger={ledger}",
            f"--steps={steps}",
            f"--global-batch={GLOBAL_BATCH}",
            f"--micro-batch={MICRO_BATCH}",
            f"--seed={SEED}",
        ]
        if state is not None:
            args.append(f"--state-in={state}")
        result = launch(world, *args)
        assert result.returncode == 0, f"phase {phase} (world {world}) failed:\n{result.stdout}\n{result.stderr}"
        state = state_out
        rows = {r: (ledger / f"rank{r}.txt").read_text().splitlines() for r in range(world)}
        expected_steps = steps if steps >= 0 else (n // GLOBAL_BATCH) - sum(s for _, s in PHASES[:phase])
        assert {r: len(lines) for r, lines in rows.items()} == {r: expected_steps for r in range(world)}

    trained = Counter(
        int(i)
        for ledger in tmp_path.glob("ledger*")
        for path in ledger.glob("rank*.txt")
        for line in path.read_text().splitlines()
        for i in line.split()
    )
    perm = epoch_permutation(n, seed=SEED, epoch=0).tolist()
    end = n - n % GLOBAL_BATCH
    assert max(trained.values()) == 1, "a sample was trained twice"
    assert set(trained) == set(perm[:end])
    assert set(range(n)) - set(trained) == set(perm[end:])  # only the dropped tail was not trained
    final = torch.load(state)
    assert (final["epoch"], final["consumed"]) == (1, 0)
