"""Housekeeping never loses a checkpoint: pruning by save order, recovery of interrupted re-saves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elastic_events.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    list_checkpoints,
)
from elastic_events.checkpoint import checkpointer as checkpoint
from elastic_events.checkpoint.layout import prune, recover_interrupted


class Model:
    """A tiny model whose parameters change at every step."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 2)

    def step(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def save_steps(root: Path, steps: tuple[int, ...], keep_last: int | None = None) -> dict[int, dict[str, torch.Tensor]]:
    job, params = Model(), {}
    ckpt = Checkpointer(CheckpointConfig(dir=root, keep_last=keep_last))
    for step in steps:
        params[step] = job.step()
        ckpt.save(step, model=job.model)
    return params


def assert_params(expected: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    actual = model.state_dict()
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def truncate_shard(path: Path) -> None:
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:4])


def test_fresh_save_after_resuming_an_older_step_is_kept(tmp_path: Path) -> None:
    """keep_last=1, {100 (with marker), 50}, resume from 50, save 51: 51 stays, not 100."""
    save_steps(tmp_path, (50, 100))
    job = Model(seed=1)
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path, keep_last=1))
    loaded = ckpt.load(model=job.model, step=50)
    assert loaded is not None and loaded.step == 50
    fresh = job.step()
    ckpt.save(51, model=job.model)
    assert names(tmp_path) == ["step_000000051"]
    again = Model(seed=2)
    reloaded = Checkpointer(CheckpointConfig(dir=tmp_path)).load(model=again.model)
    assert reloaded is not None and reloaded.step == 51
    assert_params(fresh, again.model)


def test_fresh_save_after_skipping_a_damaged_newer_checkpoint_is_kept(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, (50, 100))
    truncate_shard(tmp_path / "step_000000100")
    job = Model(seed=1)
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path, keep_last=1))
    with pytest.warns(CheckpointWarning, match="step_000000100.*truncated"):
        loaded = ckpt.load(model=job.model)
    assert loaded is not None and loaded.step == 50
    assert_params(saved[50], job.model)
    job.step()
    ckpt.save(51, model=job.model)
    assert names(tmp_path) == ["step_000000051"]


def test_sequence_records_save_order(tmp_path: Path) -> None:
    save_steps(tmp_path, (9, 3, 7))
    order = {info.step: info.sequence for info in list_checkpoints(tmp_path)}
    assert order == {9: 1, 3: 2, 7: 3}


def test_prune_keeps_checkpoints_saved_after_the_one_just_saved(tmp_path: Path) -> None:
    save_steps(tmp_path, (5, 7))
    removed = prune(tmp_path, keep_last=1, saved=tmp_path / "step_000000005")
    assert removed == [] and names(tmp_path) == ["step_000000005", "step_000000007"]


def test_prune_never_removes_the_only_loadable_checkpoint(tmp_path: Path) -> None:
    save_steps(tmp_path, (1, 2))
    truncate_shard(tmp_path / "step_000000002")  # damaged after its commit (e.g. by a full disk elsewhere)
    removed = prune(tmp_path, keep_last=1, saved=tmp_path / "step_000000002")
    assert removed == [] and names(tmp_path) == ["step_000000001", "step_000000002"]


def test_crash_between_the_two_renames_of_a_resave_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = save_steps(tmp_path, (3,), keep_last=1)
    job = Model(seed=1)
    real_replace = os.replace

    def crash_before_second_rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if ".tmp-" in Path(src).name and Path(dst).name == "step_000000003":
            raise OSError(5, "Input/output error (simulated crash)")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_before_second_rename)
    with pytest.raises(CheckpointError, match="Input/output error"):
        Checkpointer(CheckpointConfig(dir=tmp_path, keep_last=1)).save(3, model=job.model)
    monkeypatch.undo()
    left = names(tmp_path)
    assert "step_000000003" not in left and any(".old-" in n for n in left), left
    assert not any(".tmp-" in n for n in left), left  # the failed save's new copy gave its space back
    # A new start recovers the committed copy and loads it.
    fresh = Model(seed=2)
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path, keep_last=1))
    loaded = ckpt.load(model=fresh.model)
    assert loaded is not None and loaded.step == 3
    assert_params(saved[3], fresh.model)
    fresh.step()
    ckpt.save(4, model=fresh.model)
    assert names(tmp_path) == ["step_000000004"]


def test_recover_interrupted_leaves_superseded_copies_alone(tmp_path: Path) -> None:
    save_steps(tmp_path, (3,))
    stale = tmp_path / "step_000000003.old-0badc0de"
    stale.mkdir()
    assert recover_interrupted(tmp_path) == []
    assert stale.is_dir() and (tmp_path / "step_000000003" / "COMPLETE").is_file()
