"""The Lightning ElasticCallback refuses what could not resume elastically, before training."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from elastic_events.integrations.lightning import ElasticCallback, ElasticIntegrationError, GlobalBatchError


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.linear(batch.float().unsqueeze(-1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(callback: ElasticCallback, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[callback],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_another_accumulation_is_refused(tmp_path) -> None:
    elastic = ElasticCallback(dirpath=tmp_path, global_batch=8, micro_batch=2)
    with pytest.raises(ElasticIntegrationError, match="accumulate_grad_batches=3.*accumulation 4 at world size 1"):
        _trainer(elastic, accumulate_grad_batches=3).fit(_Model(), elastic.dataloader(torch.arange(16)))


def test_a_loader_not_made_by_the_callback_is_refused(tmp_path) -> None:
    elastic = ElasticCallback(dirpath=tmp_path, global_batch=8, micro_batch=2)
    with pytest.raises(ElasticIntegrationError, match=r"not made by ElasticCallback.dataloader\(\)"):
        _trainer(elastic).fit(_Model(), torch.utils.data.DataLoader(torch.arange(16), batch_size=2))


def test_the_callback_sets_the_accumulation_and_trains_whole_global_batches(tmp_path) -> None:
    elastic = ElasticCallback(dirpath=tmp_path, global_batch=8, micro_batch=2)
    trainer = _trainer(elastic)
    trainer.fit(_Model(), elastic.dataloader(torch.arange(16)))
    assert trainer.accumulate_grad_batches == 4 and trainer.global_step == 2
    assert elastic.sampler.state_dict()["epoch"] == 1  # 2 steps of 8: the epoch of 16 is done
    assert not elastic.stopped_for_event and not list(tmp_path.iterdir())  # no event: nothing saved


@pytest.mark.parametrize(("global_batch", "micro_batch"), [(0, 2), (8, 0), (8, 3)])
def test_bad_batch_sizes_are_refused(tmp_path, global_batch: int, micro_batch: int) -> None:
    with pytest.raises(GlobalBatchError):
        ElasticCallback(dirpath=tmp_path, global_batch=global_batch, micro_batch=micro_batch)
