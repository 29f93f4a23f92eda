"""Checkpointer: atomic saves, fallback past damaged checkpoints, resharding DCP loads.

Unit tests run in this process (torch.distributed not initialised); the integration
tests launch real gloo ranks with ``torch.distributed.run`` and compare what every
rank loads at world sizes 1, 2 and 3 with the full state dumped at save time.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_events.checkpoint import (
    MARKER_NAME,
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    IncompatibleCheckpointError,
    list_checkpoints,
    verify_checkpoint,
)
from elastic_events.checkpoint import checkpointer as checkpoint
from elastic_events.data.sampler import ElasticSampler
from elastic_events.rng import derive_rank_seed
from support.launch import clean_env, run, torchrun_cmd

WORKERS = Path(__file__).resolve().parent / "workers"
SRC = Path(__file__).resolve().parents[2] / "src"


# ------------------------------------------------------------------------- helpers


class Job:
    """A tiny model with optimizer, scheduler and sampler, trained one step at a time."""

    def __init__(self, seed: int = 0, hidden: int = 5) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.data = ElasticSampler(40, global_batch=4, micro_batch=2, rank=0, world_size=1)

    def train_step(self) -> None:
        self.model(torch.randn(3, 4)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.data.load_state_dict({**self.data.state_dict(), "consumed": self.data.consumed + 4})

    def targets(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "data": self.data}

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_same(expected: Any, actual: Any, where: str = "state") -> None:
    """Exact, recursive equality of nested dicts/lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), f"{where} differs"
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), f"{where}: keys differ: {set(expected) ^ set(actual)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{where}: length differs"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def saved_job(tmp_path: Path, steps: tuple[int, ...]) -> tuple[Checkpointer, dict[int, dict]]:
    """Train, saving after each step in ``steps``; return the params at each saved step."""
    job = Job()
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path / "ckpt", keep_last=None))
    snapshots = {}
    for step in steps:
        job.train_step()
        ckpt.save(step, **job.targets())
        snapshots[step] = job.params()
    ckpt.close()
    return ckpt, snapshots


# --------------------------------------------------------------------- config, rng


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dir": ""}, "dir"),
        ({"dir": 3}, "dir"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": 2.5}, "keep_last"),
        ({"async_save": "yes"}, "async_save"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"io_threads": 0}, "io_threads"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**{"dir": "/tmp/x", **kwargs})


def test_config_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        CheckpointConfig("/tmp/x")  # type: ignore[misc]


def test_derived_rank_seeds_are_deterministic_and_distinct() -> None:
    seeds = {derive_rank_seed(1000, step, rank) for step in range(4) for rank in range(8)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 for s in seeds)
    assert derive_rank_seed(1000, 3, 2) == derive_rank_seed(1000, 3, 2)
    with pytest.raises(ValueError, match="rank"):
        derive_rank_seed(1000, 3, -1)


# -------------------------------------------------------------- single-process I/O


ASYNC_SINGLE_PROCESS = "ignore:torch.distributed is disabled"  # DCP's notice, from its writer thread


@pytest.mark.filterwarnings(ASYNC_SINGLE_PROCESS)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_restores_every_component(tmp_path: Path, async_save: bool) -> None:
    job = Job()
    for _ in range(3):
        job.train_step()
    expected = {name: copy.deepcopy(obj.state_dict()) for name, obj in job.targets().items()}
    torch.manual_seed(123)
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path, async_save=async_save))
    path = ckpt.save(3, **job.targets(), extra={"tokens": 96, "ema": torch.ones(2)})
    draw = torch.rand(3)
    job.train_step()  # the live state moves on while an async save may still be writing
    committed = ckpt.wait()
    assert (committed is not None) == async_save  # wait() returns what it waited for
    assert path == tmp_path / "step_000000003" and (path / MARKER_NAME).is_file()

    fresh = Job(seed=99)
    loaded = Checkpointer(CheckpointConfig(dir=tmp_path)).load(**fresh.targets())
    assert loaded is not None and loaded.step == 3 and loaded.rng == "restored" and not loaded.resharded
    assert loaded.info.components == ("model", "optimizer", "scheduler", "data", "extra")
    assert_same({"tokens": 96, "ema": torch.ones(2)}, loaded.extra, "extra")
    for name, obj in fresh.targets().items():
        assert_same(expected[name], obj.state_dict(), name)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**3)
    assert torch.equal(torch.rand(3), draw), "RNG not restored to its state at save time"


def test_no_checkpoint_loads_nothing(tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path / "never-created"))
    assert ckpt.latest() is None
    assert ckpt.load(model=Job().model) is None


def test_latest_orders_by_step_not_by_save_time(tmp_path: Path) -> None:
    ckpt, _ = saved_job(tmp_path, (5, 12, 9))
    assert [info.step for info in list_checkpoints(tmp_path / "ckpt")] == [12, 9, 5]
    (tmp_path / "ckpt" / "step_000000099").mkdir()  # no marker: not a checkpoint
    latest = ckpt.latest()
    assert latest is not None and latest.step == 12 and latest.world_size == 1
    assert latest.torch_version == torch.__version__


def test_keep_last_prunes_old_checkpoints_and_partial_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    crashed = root / "step_000000002.tmp-0badc0de"
    crashed.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    writer = {"host": socket.gethostname(), "pid": int(gone.stdout), "started": 0.0}
    (crashed / "WRITER").write_text(json.dumps(writer))  # a save whose writer crashed
    job = Job()
    ckpt = Checkpointer(CheckpointConfig(dir=root, keep_last=2))
    for step in range(1, 6):
        job.train_step()
        ckpt.save(step, **job.targets())
    assert sorted(os.listdir(root)) == ["step_000000004", "step_000000005"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    job = Job()
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path))
    ckpt.save(3, model=job.model)
    job.train_step()
    ckpt.save(3, model=job.model)
    assert os.listdir(tmp_path) == ["step_000000003"]
    fresh = Job(seed=5)
    ckpt.load(model=fresh.model)
    assert_same(job.params(), fresh.params())


def test_failed_commit_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, snapshots = saved_job(tmp_path, (1,))
    job = Job(seed=4)

    def disk_full(directory: Path, info: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_marker", disk_full)
    with pytest.raises(CheckpointError, match="committing .*step_000000002.tmp-.* No space left on device"):
        ckpt.save(2, model=job.model)
    monkeypatch.undo()
    assert [info.step for info in list_checkpoints(tmp_path / "ckpt")] == [1]
    assert not list((tmp_path / "ckpt").glob("*.tmp-*"))  # the failed save gave its space back
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        loaded = ckpt.load(model=job.model)
    assert loaded is not None and loaded.step == 1
    assert_same(snapshots[1], job.params())


@pytest.mark.filterwarnings(ASYNC_SINGLE_PROCESS)
def test_async_saves_are_serialised(tmp_path: Path) -> None:
    job = Job()
    with Checkpointer(CheckpointConfig(dir=tmp_path, async_save=True, keep_last=None)) as ckpt:
        for step in (1, 2, 3):
            job.train_step()
            ckpt.save(step, **job.targets())
    assert [info.step for info in list_checkpoints(tmp_path)] == [3, 2, 1]
    for info in list_checkpoints(tmp_path):
        verify_checkpoint(info.path)


# ----------------------------------------------------------- damage and fallback


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "no marker": (lambda d: (d / MARKER_NAME).unlink(), "no COMPLETE marker"),
    "bad marker": (lambda d: (d / MARKER_NAME).write_text("{"), "unreadable COMPLETE marker"),
    "no metadata": (lambda d: (d / ".metadata").unlink(), "no .metadata file"),
    "truncated metadata": (lambda d: _truncate(d / ".metadata"), "unreadable .metadata"),
    "missing shard": (lambda d: (d / "__0_0.distcp").unlink(), "shard file __0_0.distcp is missing"),
    "truncated shard": (lambda d: _truncate(d / "__0_0.distcp"), "shard file __0_0.distcp is truncated"),
    "zeroed shard": (lambda d: _zero(d / "__0_0.distcp"), "DCP load failed"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_is_reported_and_previous_loaded(tmp_path: Path, damage: str) -> None:
    ckpt, snapshots = saved_job(tmp_path, (1, 2))
    newest = _step_dir(tmp_path / "ckpt", 2)
    corrupt, reason = DAMAGE[damage]
    corrupt(newest)
    fresh = Job(seed=7)
    with pytest.warns(CheckpointWarning) as record:
        loaded = ckpt.load(**fresh.targets())
    messages = [str(w.message) for w in record if issubclass(w.category, CheckpointWarning)]
    assert len(messages) == 1 and messages[0].startswith(f"skipping checkpoint {newest}: "), messages
    assert reason in messages[0]
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (newest,)
    assert_same(snapshots[1], fresh.params())


def test_partial_save_is_reported_and_never_loaded(tmp_path: Path) -> None:
    ckpt, snapshots = saved_job(tmp_path, (1, 2))
    partial = tmp_path / "ckpt" / "step_000000003.tmp-0123abcd"
    shutil.copytree(_step_dir(tmp_path / "ckpt", 2), partial)  # all files there, only the rename missing
    fresh = Job(seed=7)
    with pytest.warns(CheckpointWarning, match=f"skipping checkpoint {partial}: partial save"):
        loaded = ckpt.load(**fresh.targets())
    assert loaded is not None and loaded.step == 2
    assert_same(snapshots[2], fresh.params())


def test_all_damaged_raises_naming_every_path(tmp_path: Path) -> None:
    ckpt, _ = saved_job(tmp_path, (1, 2))
    paths = [_step_dir(tmp_path / "ckpt", step) for step in (1, 2)]
    _truncate(paths[0] / ".metadata")
    (paths[1] / "__0_0.distcp").unlink()
    with warnings.catch_warnings(record=True) as seen, pytest.raises(CheckpointError) as excinfo:
        warnings.simplefilter("always")
        ckpt.load(model=Job().model)
    assert not [w for w in seen if issubclass(w.category, CheckpointWarning)]  # the error says it all, once
    assert all(str(p) in str(excinfo.value) for p in paths)
    assert "unreadable .metadata" in str(excinfo.value) and "missing" in str(excinfo.value)


def test_explicit_step_is_loaded_or_refused(tmp_path: Path) -> None:
    ckpt, snapshots = saved_job(tmp_path, (1, 2))
    fresh = Job(seed=3)
    loaded = ckpt.load(model=fresh.model, step=1)
    assert loaded is not None and loaded.step == 1
    assert_same(snapshots[1], fresh.params())
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        ckpt.load(model=fresh.model, step=7)
    (_step_dir(tmp_path / "ckpt", 2) / ".metadata").unlink()
    with pytest.raises(CheckpointCorruptError) as excinfo:
        ckpt.load(model=fresh.model, step=2)
    assert excinfo.value.path == _step_dir(tmp_path / "ckpt", 2) and "no .metadata" in excinfo.value.reason


def test_mismatched_model_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    ckpt, _ = saved_job(tmp_path, (1, 2))
    with pytest.raises(IncompatibleCheckpointError, match=r"'0.weight' has shape \(5, 4\), the model has \(6, 4\)"):
        ckpt.load(model=Job(hidden=6).model)


def test_state_its_owner_refuses_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    ckpt, _ = saved_job(tmp_path, (1, 2))
    job = Job()
    job.data = ElasticSampler(48, global_batch=4, micro_batch=2, rank=0, world_size=1)  # the dataset grew
    with pytest.raises(IncompatibleCheckpointError, match="step_000000002 does not fit: SamplerStateError"):
        ckpt.load(**job.targets())


def test_requesting_state_the_checkpoint_lacks_is_an_error(tmp_path: Path) -> None:
    job = Job()
    ckpt = Checkpointer(CheckpointConfig(dir=tmp_path))
    ckpt.save(1, model=job.model)
    with pytest.raises(IncompatibleCheckpointError, match="has no optimizer, scheduler state"):
        ckpt.load(model=job.model, optimizer=job.optimizer, scheduler=job.scheduler)


# ------------------------------------------------------------ real ranks (gloo)

RESHARD_WORKER = WORKERS / "ckpt_reshard.py"
SAVE_WORLD = 2
WRAPS = ("ddp", "fsdp", "hsdp")  # hsdp: saved on a 1 x 2 mesh, loaded on 1 x 1, 1 x 2 and 3 x 1
RNG_SEED = 1000  # ckpt_reshard.RNG_SEED
TRAIN_STEPS = 3  # ckpt_reshard.TRAIN_STEPS


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 180) -> None:
    cmd = torchrun_cmd("--standalone", "--nproc-per-node", str(nproc), str(script), *args)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = run(cmd, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script.name} {args} at world {nproc} failed:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reshard")
    torchrun(SAVE_WORLD, RESHARD_WORKER, "save", str(out))
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"load_at_{w}")
def loaded(request: pytest.FixtureRequest, saved: Path) -> tuple[int, list[dict]]:
    world = request.param
    torchrun(world, RESHARD_WORKER, "load", str(saved))
    return world, [torch.load(saved / f"loaded_w{world}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_reshard_loads_exactly_the_saved_state(saved: Path, loaded: tuple[int, list[dict]], wrap: str) -> None:
    world, per_rank = loaded
    reference = torch.load(saved / f"reference_{wrap}.pt", weights_only=False)
    assert reference["optimizer"]["state"], "the reference has no optimizer state to compare"
    for rank, result in enumerate(per_rank):
        got = result[wrap]
        for part in ("model", "optimizer", "scheduler", "data"):
            assert_same(reference[part], got[part], f"{wrap} rank {rank}/{world} {part}")
        assert_same(reference["extra"], got["extra"], f"{wrap} rank {rank}/{world} extra")
        assert got["step"] == TRAIN_STEPS and got["saved_world"] == SAVE_WORLD


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_rng_is_restored_at_the_same_world_and_reseeded_otherwise(
    saved: Path, loaded: tuple[int, list[dict]], wrap: str
) -> None:
    world, per_rank = loaded
    draws = [result[wrap]["draw"] for result in per_rank]
    if world == SAVE_WORLD:
        saved_draws = [torch.load(saved / f"saved_rank{r}.pt", weights_only=False)[wrap]["draw"] for r in (0, 1)]
        assert [result[wrap]["rng"] for result in per_rank] == ["restored"] * world
        assert not torch.equal(saved_draws[0], saved_draws[1])
        for rank in range(world):
            assert torch.equal(draws[rank], saved_draws[rank]), f"rank {rank} did not get its own RNG stream back"
    else:
        assert [result[wrap]["rng"] for result in per_rank] == ["reseeded"] * world
        for rank in range(world):
            expected = torch.rand(4, generator=torch.Generator().manual_seed(derive_rank_seed(RNG_SEED, 3, rank)))
            assert torch.equal(draws[rank], expected), f"rank {rank} was not re-seeded from (seed, step, rank)"


@pytest.mark.slow
def test_unshared_storage_is_detected_on_load_and_save(tmp_path: Path) -> None:
    Checkpointer(CheckpointConfig(dir=tmp_path / "node0")).save(1, model=torch.nn.Linear(3, 2))
    torchrun(2, WORKERS / "ckpt_nonshared.py", str(tmp_path), timeout=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"result_rank{rank}.json").read_text())
        for action in ("load", "save"):
            assert result[action]["type"] == "SharedStorageError", (rank, action, result)
            assert "shared by all nodes" in result[action]["message"]
        assert "rank 1" in result["load"]["message"] and "step_000000001" in result["load"]["message"]
        assert "__1_0.distcp is missing" in result["save"]["message"]
    assert [info.step for info in list_checkpoints(tmp_path / "node0")] == [1], "a save that failed was committed"
