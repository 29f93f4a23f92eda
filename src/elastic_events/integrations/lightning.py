"""Elastic Lightning 2.x ``Trainer`` (DDP; HSDP on the restart path): one callback, its data loader, in-place scale events.

Before (torchrun, fixed size)::

    trainer = L.Trainer(strategy="ddp", max_steps=1000, accumulate_grad_batches=4)
    trainer.fit(model, DataLoader(ds, batch_size=8, shuffle=True))

After (hyperpodrun, any size between the ``--nnodes`` bounds, ranks kept through scale events)::

    elastic_init()                                   # a pre-warmed joiner waits here to be admitted
    elastic = ElasticCallback(dirpath="ckpt", global_batch=256, micro_batch=8)
    trainer = L.Trainer(strategy="ddp", num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), max_steps=1000,
                        callbacks=[elastic], use_distributed_sampler=False)
    elastic.fit(trainer, model, elastic.dataloader(ds), ckpt_path=elastic_resume_checkpoint("ckpt"))

(In a ``LightningDataModule``, return ``elastic.dataloader(self.train_set)`` from
``train_dataloader()``.) ``trainer.fit(...)`` instead of ``elastic.fit(trainer, ...)``, or
no :func:`elastic_init`, is elastic on the *restart path*: at every event the ranks save a
Lightning checkpoint and the launcher restarts them. ``lightning.pytorch`` is used when
installed, else ``pytorch_lightning``.

How it works, in Lightning's own terms:

* **Global batch.** In :meth:`ElasticCallback.setup` the callback sets
  ``trainer.accumulate_grad_batches`` to ``global_batch / (micro_batch x world
  size)`` (as Lightning's own ``GradientAccumulationScheduler`` does), or raises
  :class:`GlobalBatchError` naming the world sizes that cannot keep it.
* **Data order.** :meth:`ElasticCallback.dataloader` draws batches with
  :class:`elastic_events.data.sampler.ElasticSampler`, whose state is the global
  position in the epoch: step ``s`` trains samples ``[s*G, (s+1)*G)`` of the epoch's
  order at any world size. The position is saved with the callback's state and
  restored before the loader is iterated; in place the same loader is re-split over
  the new world.
* **In place** (the launcher publishes ``RECONFIGURE``: every rank of the job offered it).
  Once per optimizer step (every rank) the callback calls
  :func:`~elastic_events.elastic_event_detected`; at the agreed step it takes
  Lightning's checkpoint in memory (``dump_checkpoint``, where the restart path saves
  it) and sets ``trainer.should_stop``. :meth:`ElasticCallback.fit` then moves the
  rank into the new round and fits again from that checkpoint, served from memory
  (:mod:`.lightning_inplace`); newcomers receive it from a survivor. A leaving node's
  ranks exit 0. Offered when :func:`elastic_init` ran, ``fit`` goes through
  :meth:`ElasticCallback.fit`, and the strategy is DDP under hyperpodrun's environment;
  otherwise one line on stderr and an ``in_place_unavailable`` record in the event log
  say why, and events take the restart path.
* **Restart path** (``SAVE_AND_EXIT``: ``--restart-mode process``, or a rank that does not
  offer in-place events). At the agreed step the callback saves a Lightning checkpoint
  (``trainer.save_checkpoint``: model, optimizers, schedulers, loops, callbacks),
  marks it complete after a barrier, sets ``trainer.should_stop`` and, when ``fit`` is
  over, exits with status 0 (the launcher restarts the script at the new size;
  ``exit_on_event=False`` returns from ``fit`` instead, with
  :attr:`ElasticCallback.stopped_for_event` set).
* **Resume.** :func:`elastic_resume_checkpoint` is the newest complete checkpoint.
  On load (from a file or from memory), the callback rescales the loop's batch
  counters of the current epoch to the new accumulation (Lightning counts
  micro-batches; the optimizer steps are what is kept), so accumulation boundaries
  and the epoch's end stay right.
* **RNG.** At a new world size, and after every in-place event, every rank is
  reseeded from ``(seed, step, rank)`` when training starts.
* **HSDP** (restart path): ``ModelParallelStrategy`` with ``fully_shard`` on :func:`hsdp_mesh` in the
  module's ``configure_model``; Lightning's sharded checkpoint loads onto the new round's mesh.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:  # checked against the unified package; the standalone one has the same classes
    from lightning.pytorch import Callback, LightningModule, Trainer
else:
    try:
        from lightning.pytorch import Callback, LightningModule, Trainer
    except ImportError:  # the standalone package
        from pytorch_lightning import Callback, LightningModule, Trainer

from elastic_events import elastic_event_detected, eventlog
from elastic_events.contract import Record
from elastic_events.data.sampler import ElasticSampler
from elastic_events.integrations import lightning_inplace
from elastic_events.integrations.common import (
    ElasticIntegrationError,
    GlobalBatchError,
    ResumeMarker,
    accumulation_steps,
    newest_marked,
    rank_and_world,
    reseed_rank,
    write_marker,
)
from elastic_events.integrations.inplace import elastic_init, rounds
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.mesh import HSDPConfig, build_mesh, plan_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ElasticCallback",
    "ElasticIntegrationError",
    "GlobalBatchError",
    "ElasticConfig",
    "elastic_init",
    "elastic_resume_checkpoint",
    "hsdp_mesh",
]

CHECKPOINT = "elastic-step={step}.ckpt"
MARKER = "{name}.elastic.json"
_BATCH_PROGRESS = "epoch_loop.batch_progress"


def elastic_resume_checkpoint(dirpath: str | os.PathLike) -> str | None:
    """The newest complete elastic checkpoint in ``dirpath`` (None: start from scratch)."""
    found = newest_marked(Path(dirpath), r"elastic-step=(\d+)\.ckpt", MARKER)
    return str(found) if found is not None else None


def hsdp_mesh(trainer: Trainer, config: HSDPConfig | None = None) -> DeviceMesh:
    """The round's ``("replicate", "shard")`` mesh, for ``fully_shard(..., mesh=hsdp_mesh(self.trainer))`` in a
    module's ``configure_model`` under ``ModelParallelStrategy(data_parallel_size=WORLD_SIZE,
    tensor_parallel_size=1)``: sharded over a node's ranks (or ``config.shard_size``), replicated across
    nodes. Every rank trains its own samples (data parallel over replicas x shards). Collective."""
    layout = plan_layout(config or HSDPConfig(), world_size=trainer.world_size, local_world_size=trainer.num_devices)
    return build_mesh(layout, trainer.strategy.root_device)


class _FullEpochSampler(ElasticSampler):
    """An :class:`ElasticSampler` whose length is the whole epoch's micro-batches at this world size.

    Lightning sizes an epoch once, from the loader's length; the loop counters the
    callback restores count from the epoch's start, so the length must too.
    """

    def __len__(self) -> int:
        return sum(self._plan_at(start).accumulation_steps() for start in self._batch_starts(0))


class ElasticCallback(Callback):
    """Act at the step hyperpodrun agrees on: go on in place (through :meth:`fit`), or save and
    stop for a restart; resume at any world size.

    Args:
        dirpath: directory of the elastic checkpoints (shared by all nodes).
        global_batch: samples per optimizer step over all ranks.
        micro_batch: samples per forward pass on one rank (the loader's batch).
        seed, shuffle: the epoch order (``seed + epoch`` permutation, or dataset order).
        exit_on_event: exit with status 0 after ``fit`` when it stopped for a restart, or when
            this rank's node leaves the job in place.
    """

    def __init__(
        self,
        *,
        dirpath: str | os.PathLike,
        global_batch: int,
        micro_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        exit_on_event: bool = True,
    ) -> None:
        accumulation_steps(global_batch=global_batch, per_device_batch=micro_batch, world_size=1)  # validates both
        self.dirpath = Path(dirpath)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.seed = seed
        self.shuffle = shuffle
        self.exit_on_event = exit_on_event
        self.stopped_for_event = False
        self.sampler: ElasticSampler | None = None
        self._accumulation = 0
        self._loaded: dict[str, Any] | None = None  # our state from the checkpoint being resumed
        self._last_step = -1
        self.in_place = False  # fit() offered in-place events for this rank
        self.resumed_in_place = False  # the next fit() resumes from memory, after an in-place event
        self.memory_checkpoint: dict[str, Any] | None = None  # what the next fit() restores from memory
        self._kept: dict[str, Any] | None = None  # Lightning's checkpoint at the in-place event (no model tensors)
        self._in_place_event: Any = None

    # ------------------------------------------------------------- in place
    def fit(
        self,
        trainer: Trainer,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        """``trainer.fit(model, ...)``, and under hyperpodrun, with :func:`elastic_init` called, through
        in-place scale events: the ranks that stay keep their process (see :mod:`.lightning_inplace`)."""
        # Lightning's callback connector sets Trainer.callbacks; the class does not declare it
        if self not in trainer.callbacks:  # type: ignore[attr-defined]
            raise ElasticIntegrationError("fit(): this ElasticCallback is not among the trainer's callbacks")
        fit_args = {
            "train_dataloaders": train_dataloaders,
            "val_dataloaders": val_dataloaders,
            "datamodule": datamodule,
            **kwargs,
        }
        lightning_inplace.fit(self, trainer, model, fit_args, ckpt_path)

    def take_in_place_event(self) -> Any:
        """The in-place event ``fit`` stopped for (None: it ended for another reason); taken once."""
        event, self._in_place_event = self._in_place_event, None
        return event

    def take_kept_checkpoint(self) -> dict[str, Any]:
        """Lightning's checkpoint taken at the in-place event, without the model's tensors (they travel from the module)."""
        kept, self._kept = self._kept, None
        if kept is None:
            raise ElasticIntegrationError("no checkpoint was taken at the in-place event")
        return kept

    # ------------------------------------------------------------------ data
    def dataloader(self, dataset: Dataset, **loader_kwargs: Any) -> DataLoader:
        """A loader over ``dataset`` in the elastic order, at the trained position (call from ``train_dataloader``)."""
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if name in loader_kwargs:
                raise ElasticIntegrationError(f"dataloader(): {name} is set by the elastic sampler; leave it out")
        if not isinstance(dataset, Sized):
            raise ElasticIntegrationError("dataloader(): the elastic order needs a map-style dataset with a length")
        rank, world = rank_and_world()
        sampler = _FullEpochSampler(
            len(dataset),
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            rank=rank,
            world_size=world,
            seed=self.seed,
            shuffle=self.shuffle,
        )
        if self._loaded is not None:
            sampler.load_state_dict(self._loaded["sampler"])
        self.sampler = sampler
        return DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        _, world = rank_and_world()
        return {
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "world_size": world,
            "accumulation": self._accumulation,
            "global_batch": self.global_batch,
        }

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _, world = rank_and_world()
        previous = self._accumulation  # what this callback set for the last fit (in place: another world)
        self._accumulation = accumulation_steps(
            global_batch=self.global_batch, per_device_batch=self.micro_batch, world_size=world
        )
        if trainer.accumulate_grad_batches not in (1, previous, self._accumulation):
            raise ElasticIntegrationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with the elastic "
                f"global batch {self.global_batch} (accumulation {self._accumulation} at world size {world}); leave it out"
            )
        trainer.accumulate_grad_batches = self._accumulation
        self.stopped_for_event = False
        if not self.in_place:  # under hyperpodrun: say once why events take the restart path
            rounds().offer("lightning", ["fit() was called on the Trainer, not as ElasticCallback.fit(trainer, ...)"])
        self._in_place_event = None
        self._loaded = None
        if self.sampler is not None and (self.sampler.rank, self.sampler.world_size) != rank_and_world():
            rank, world = rank_and_world()
            self.sampler.set_world(rank=rank, world_size=world)  # fit again in place: the same loader, a new world

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Before Lightning restores its loops: take our state, and recount the epoch's batches at the new accumulation."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state or state.get("sampler") is None:
            return
        if state["global_batch"] != self.global_batch:
            raise GlobalBatchError(
                f"the checkpoint was trained with global batch {state['global_batch']} at world size "
                f"{state['world_size']}; this run has global batch {self.global_batch}"
            )
        self._loaded = state
        if self.sampler is not None:  # the loader was built before fit(); it is iterated only after this
            self.sampler.load_state_dict(state["sampler"])
        old, new = state["accumulation"], self._accumulation
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get(_BATCH_PROGRESS)
        if progress is not None and old != new:
            current, total = progress["current"], progress["total"]
            ready = current["ready"]
            steps = ready // old  # saved at a step boundary: ready == processed == steps * old
            for key in ("ready", "started", "processed", "completed"):
                lag = ready - current[key]  # completed trails by one when saved in on_train_batch_end
                total[key] += steps * new - ready
                current[key] = steps * new - lag

    def _loader_sampler(self) -> ElasticSampler:
        """The sampler of the loader :meth:`dataloader` made."""
        if self.sampler is None:
            raise ElasticIntegrationError(
                "the training loader was not made by ElasticCallback.dataloader(); return it from train_dataloader() "
                "and pass use_distributed_sampler=False to the Trainer"
            )
        return self.sampler

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loader_sampler()  # refuses a loader that dataloader() did not make
        self._last_step = trainer.global_step
        rank, world = rank_and_world()
        if self.resumed_in_place:  # from memory, after an in-place event: a new round, maybe a new world
            self.resumed_in_place = False
            reseed_rank(self.seed, trainer.global_step, rank)
            return
        if self._loaded is None:
            return
        if self._loaded["world_size"] != world:
            reseed_rank(self.seed, trainer.global_step, rank)
        eventlog.emit(Record.CHECKPOINT_LOADED, step=trainer.global_step, saved_world_size=self._loaded["world_size"])

    # ------------------------------------------------------------------ stop
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # a micro-batch inside an accumulation: no optimizer step yet
        self._last_step = trainer.global_step
        self._loader_sampler().mark_step()
        if not elastic_event_detected():
            return
        event = rounds().take_event()
        if self.in_place and rounds().is_in_place(event):
            # Lightning's checkpoint, where the restart path saves it, kept in memory: tensors referenced, not copied
            kept = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            kept.pop("state_dict", None)  # the model's tensors travel from the module itself
            self._kept, self._in_place_event = kept, event
            trainer.should_stop = True
            return
        if event is not None:
            rounds().restart_requested(event, step=trainer.global_step)
        self.stopped_for_event = True
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / CHECKPOINT.format(step=trainer.global_step)
        trainer.save_checkpoint(path)
        trainer.strategy.barrier("elastic_checkpoint_saved")  # every rank finished its part
        if trainer.is_global_zero:
            rank, world = rank_and_world()
            marker = ResumeMarker(
                step=trainer.global_step, world_size=world, global_batch=self.global_batch, seed=self.seed
            )
            write_marker(self.dirpath / MARKER.format(name=path.name), marker)
            eventlog.emit(Record.CHECKPOINT_SAVED, step=trainer.global_step, path=str(path))
        trainer.should_stop = True

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """``fit`` completed (Lightning calls it on no exception): the end of training, unless it stopped for an event."""
        if not self.stopped_for_event and self._in_place_event is None:
            rounds().finished(step=trainer.global_step)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.stopped_for_event and self.exit_on_event and not self.in_place:  # fit() exits itself
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            sys.exit(0)
