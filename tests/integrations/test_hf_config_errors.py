"""ElasticCallback refuses, at train() start, the Trainer configurations that could not resume elastically."""

from __future__ import annotations

import pytest
import torch
import transformers

from elastic_events.integrations.transformers import (
    ElasticCallback,
    ElasticIntegrationError,
    ElasticTrainer,
    GlobalBatchError,
    _check_fsdp,
)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor(float(i))}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


def _trainer(tmp_path, *, n: int = 16, cls=transformers.Trainer, global_batch: int = 8, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    args = transformers.TrainingArguments(**{**kwargs, **overrides})
    return cls(
        model=_Model(), args=args, train_dataset=_Data(n), callbacks=[ElasticCallback(global_batch=global_batch)]
    )


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"gradient_accumulation_steps": 2},
            GlobalBatchError,
            r"2 x gradient_accumulation_steps 2 x world size 1 = 4, not the global batch 8",
        ),
        ({"ignore_data_skip": True}, ElasticIntegrationError, "ignore_data_skip=True restarts the epoch's data order"),
        ({"n": 20}, ElasticIntegrationError, "20 samples, not a multiple of the global batch 8"),
    ],
)
def test_non_elastic_configurations_are_refused(tmp_path, overrides, error, match) -> None:
    trainer = _trainer(tmp_path, **overrides)
    with pytest.raises(error, match=match):
        trainer.train()


@pytest.mark.parametrize(
    ("kind", "refused"), [("LOCAL_STATE_DICT", True), ("SHARDED_STATE_DICT", False), ("FULL_STATE_DICT", False)]
)
def test_fsdp_checkpoints_must_reshard(tmp_path, kind: str, refused: bool) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        fsdp="full_shard",
        fsdp_config={"state_dict_type": kind},
    )
    if refused:
        with pytest.raises(
            ElasticIntegrationError, match=f"state_dict_type={kind} checkpoints load only at the world size"
        ):
            _check_fsdp(args)
    else:
        _check_fsdp(args)


def test_elastic_trainer_trains_whole_global_batches_of_any_dataset(tmp_path) -> None:
    trainer = _trainer(tmp_path, n=20, cls=ElasticTrainer, max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4
    assert len(trainer.get_train_dataloader()) == 8  # 16 of 20 samples: 2 global batches of 4 micro-batches
