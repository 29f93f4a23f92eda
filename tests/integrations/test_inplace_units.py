"""The in-place half of the framework integrations, without a launcher: configuration, what a rank
offers on a real control channel, a pre-warmed joiner's wait, and why a job falls back to restarts.

Each case that touches this process's in-place state (``elastic_init`` runs once per process)
runs in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest

from elastic_events.contract import CONTROL_FILE_ENV, PARKED_ENV
from elastic_events.control import CAP_RECONFIGURE, ControlWriter, RankPhase
from support.launch import clean_env


def _run(code: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_env(), **(env or {})},
    )


@pytest.fixture
def channel(tmp_path: Path):
    """A real control channel for one local rank, as a launcher creates it; the env a rank gets for it."""
    writer = ControlWriter(tmp_path / "control.bin", 1)
    yield writer, {CONTROL_FILE_ENV: str(writer.path), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    writer.close()


def test_outside_hyperpodrun_nothing_is_offered_and_training_is_unchanged(tmp_path: Path) -> None:
    proc = _run(f"""
        import torch, transformers
        from elastic_events.integrations.inplace import InPlaceError, rounds
        from elastic_events.integrations.transformers import ElasticCallback, ElasticTrainer, elastic_init

        class Data(torch.utils.data.Dataset):
            def __len__(self): return 16
            def __getitem__(self, i): return {{"x": torch.tensor([float(i)]), "labels": torch.tensor(float(i))}}

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.linear = torch.nn.Linear(1, 1)
            def forward(self, x, labels):
                return {{"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}}

        elastic_init()
        try:
            elastic_init()
        except InPlaceError as exc:
            print("again:", exc)
        args = transformers.TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=2,
            gradient_accumulation_steps=4, max_steps=3, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
        callback = ElasticCallback(global_batch=8)
        trainer = ElasticTrainer(model=Model(), args=args, train_dataset=Data(), callbacks=[callback])
        out = trainer.train()
        print("offered:", rounds().offer("transformers", []), "in_place:", callback.in_place, "steps:", out.global_step)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "again: elastic_init() was already called in this process" in proc.stdout
    assert "offered: False in_place: False steps: 3" in proc.stdout
    assert "not offered" not in proc.stderr  # nothing to say outside a launcher


def test_a_parked_rank_needs_the_control_channel() -> None:
    proc = _run("from elastic_events.integrations.inplace import elastic_init; elastic_init()", env={PARKED_ENV: "1"})
    assert proc.returncode != 0
    assert "HYPERPODRUN_PARKED=1 needs the control channel" in proc.stderr.strip().splitlines()[-1]


def test_a_rank_declares_in_place_events_only_after_elastic_init(channel) -> None:
    writer, env = channel
    proc = _run(
        """
        from elastic_events.integrations.inplace import rounds
        print("offered:", rounds().offer("lightning", []))
    """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "offered: False" in proc.stdout
    assert "in-place scale events not offered (lightning): the script did not call elastic_init()" in proc.stderr
    assert "scale events save a checkpoint and restart the ranks" in proc.stderr
    assert not writer.progress()[0].reconfigurable

    proc = _run(
        """
        from elastic_events.integrations.inplace import elastic_init, rounds
        elastic_init()
        print("blocked:", rounds().offer("transformers", ["FSDP: not re-sharded in place"]))
        print("offered:", rounds().offer("transformers", []))
    """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blocked: False" in proc.stdout and "offered: False" in proc.stdout  # a rank that refused once stays refused
    assert "not offered (transformers): FSDP: not re-sharded in place" in proc.stderr
    assert not writer.progress()[0].reconfigurable

    proc = _run(
        """
        from elastic_events.integrations.inplace import elastic_init, rounds
        elastic_init()
        print("offered:", rounds().offer("transformers", []))
    """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "offered: True" in proc.stdout
    slot = writer.progress()[0]
    assert slot.capabilities & CAP_RECONFIGURE and slot.phase is RankPhase.RUNNING


def test_a_parked_rank_waits_for_admission_within_its_timeout(channel) -> None:
    writer, env = channel
    proc = _run(
        """
        import time
        from elastic_events.control import AdmissionTimeoutError
        from elastic_events.integrations.inplace import elastic_init
        from elastic_events.rounds.config import ElasticConfig
        t0 = time.monotonic()
        try:
            elastic_init(config=ElasticConfig(admission_timeout_s=0.5, poll_s=0.01))
        except AdmissionTimeoutError as exc:
            print(f"waited {time.monotonic() - t0:.1f}s:", exc)
    """,
        env={**env, PARKED_ENV: "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parked rank was not admitted into a round within 0s" in proc.stdout or "within 1s" in proc.stdout
    assert writer.progress()[0].phase is RankPhase.PARKED  # the launcher saw it parked, waiting


def _hf_trainer(**changes):
    args = SimpleNamespace(auto_find_batch_size=False, n_gpu=1)
    base = dict(
        is_deepspeed_enabled=False,
        is_fsdp_enabled=False,
        is_distributed_loading_by_transformers=False,
        model_init=None,
        is_model_parallel=False,
        args=args,
    )
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({"is_fsdp_enabled": True}, "FSDP: accelerate's sharded model and optimizer are not re-sharded in place"),
        ({"is_deepspeed_enabled": True}, "DeepSpeed"),
        ({"model_init": lambda: None}, "model_init: the Trainer builds a new model at every train()"),
        ({"args": SimpleNamespace(auto_find_batch_size=True, n_gpu=1)}, "auto_find_batch_size"),
        ({"args": SimpleNamespace(auto_find_batch_size=False, n_gpu=2)}, "DataParallel"),
    ],
)
def test_hf_configurations_that_cannot_train_in_place_are_named(changes, reason) -> None:
    from elastic_events.integrations.transformers_inplace import in_place_blockers

    blockers = in_place_blockers(_hf_trainer(**changes))
    assert blockers == [] if reason is None else len(blockers) == 1 and reason in blockers[0]


def test_lightning_strategies_other_than_ddp_are_named() -> None:
    from elastic_events.integrations.lightning_inplace import in_place_blockers

    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    assert in_place_blockers(trainer, model=None) == [
        "strategy SingleDeviceStrategy: only DDP ('ddp') is rebuilt in place",
        "fit() without the LightningModule: in-place events need the model to carry",
    ]


def test_segments_of_a_train_call_report_one_loss_over_their_steps() -> None:
    from transformers.trainer_utils import TrainOutput

    from elastic_events.integrations.transformers_inplace import _combined

    out = _combined(
        [(TrainOutput(10, 2.0, {"train_loss": 2.0}), 10), (TrainOutput(40, 1.0, {"train_loss": 1.0, "x": 1}), 30)]
    )
    assert out.global_step == 40 and out.training_loss == pytest.approx(1.25)
    assert out.metrics == {"train_loss": pytest.approx(1.25), "x": 1}
