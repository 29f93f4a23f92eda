"""Elastic Hugging Face ``Trainer``: one callback, the Trainer's own checkpoints, and in-place scale events.

Before (torchrun, fixed size)::

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, ...)
    trainer = Trainer(model, args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

After (hyperpodrun, any size between the ``--nnodes`` bounds, ranks kept through scale events)::

    elastic_init()                                   # a pre-warmed joiner waits here to be admitted
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, ...)
    set_global_batch(args, 64)                       # accumulation for this world size
    trainer = ElasticTrainer(model, args, train_dataset=ds, callbacks=[ElasticCallback(global_batch=64)])
    trainer.train(resume_from_checkpoint=elastic_resume_checkpoint(args.output_dir))

A script with a plain ``Trainer`` and the callback (no :func:`elastic_init`) is elastic on
the *restart path*: at every event the Trainer saves and the launcher restarts the ranks.

How it works, in the Trainer's own terms:

* **In place** (the launcher publishes ``RECONFIGURE``: every rank of the job offered it).
  :meth:`ElasticCallback.on_step_end` (once per optimizer step, every rank) calls
  :func:`~elastic_events.elastic_event_detected`; at the agreed step it sets
  ``control.should_training_stop`` and nothing is saved. ``ElasticTrainer.train`` tears
  down the old process group, joins the new round's, brings the newcomers to the
  survivors' state from a survivor in memory (model, optimizer, scheduler, scaler,
  trainer state), rebuilds accelerate's state, the gradient accumulation and the
  ``Accelerator`` for the new world, and trains on in the same process, resuming through
  the Trainer's own resume path from memory (:mod:`.transformers_inplace`). A leaving
  node's ranks exit 0. In-place events are offered when :func:`elastic_init` ran, the
  Trainer is an :class:`ElasticTrainer` (or uses :class:`ElasticTrainerMixin`) with this
  callback, and neither FSDP nor DeepSpeed is used; otherwise one line on stderr and an
  ``in_place_unavailable`` record in the event log say why, and events take the restart path.
* **Restart path** (``SAVE_AND_EXIT``: ``--restart-mode process``, or a rank that does
  not offer in-place events). At the agreed step the callback sets ``control.should_save``
  and ``control.should_training_stop``: the Trainer writes its usual ``checkpoint-<step>``
  (model, optimizer, scheduler, RNG, trainer state) and leaves its loop.
  :meth:`~ElasticCallback.on_save` then marks the checkpoint complete (``elastic.json``,
  after a barrier), and :meth:`~ElasticCallback.on_train_end` exits the process with
  status 0 (the launcher restarts it at the new world size; ``exit_on_event=False``
  returns from ``train()`` instead, with :attr:`ElasticCallback.stopped_for_event` set).
* **Resume.** :func:`elastic_resume_checkpoint` is the newest *complete*
  checkpoint; ``Trainer.train(resume_from_checkpoint=...)`` restores model,
  optimizer, scheduler and step.
* **Data order.** The Trainer's training order is one global sequence per epoch
  (accelerate's seedable sampler, seeded with ``data_seed`` + epoch, the same at
  every world size) dealt out to ranks batch by batch. With a constant global batch
  G, optimizer step s trains exactly the samples ``[s*G, (s+1)*G)`` of that
  sequence at any world size, and the Trainer's resume skip (``global_step`` steps x
  accumulation batches per rank) lands exactly after the samples already trained,
  in place as after a restart. That holds only while every epoch is a whole number
  of global batches: the callback checks it (``len(train_dataset) % G == 0``) and
  otherwise refuses with a clear error; :class:`ElasticTrainerMixin` lifts the
  restriction by training each epoch's order truncated to whole global batches.
  ``ignore_data_skip=True`` would restart the epoch's order and is refused.
* **RNG.** At the same world size a restart restores each rank's saved RNG. At a new
  world size old ranks' streams do not map onto new ranks (and new ranks have
  none): every rank is reseeded from ``(seed, step, rank)`` before its first step,
  and so is every rank after an in-place event.
* **FSDP.** Resumes at another size need a checkpoint that can be resharded: the
  Trainer's ``FULL_STATE_DICT`` and ``SHARDED_STATE_DICT`` (written with PyTorch
  DCP) are; ``LOCAL_STATE_DICT`` is refused at start. FSDP jobs always take the
  restart path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import AcceleratorConfig
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from elastic_events import elastic_event_detected, eventlog
from elastic_events.contract import Record
from elastic_events.data.sampler import epoch_permutation
from elastic_events.integrations.common import (
    ElasticIntegrationError,
    GlobalBatchError,
    ResumeMarker,
    accumulation_steps,
    newest_marked,
    read_marker,
    reseed_rank,
    write_marker,
)
from elastic_events.integrations.inplace import elastic_init, rounds
from elastic_events.integrations.transformers_inplace import InPlaceTrainerMixin
from elastic_events.rounds.config import ElasticConfig

__all__ = [
    "ElasticCallback",
    "ElasticIntegrationError",
    "ElasticOrderSampler",
    "ElasticTrainer",
    "ElasticTrainerMixin",
    "GlobalBatchError",
    "ElasticConfig",
    "accumulation_steps",
    "elastic_init",
    "elastic_resume_checkpoint",
    "set_global_batch",
]

MARKER = "elastic.json"
_SUPPORTED_ORDERS = ("random", "sequential")


def elastic_resume_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-<step>`` under ``output_dir`` (None: start from scratch).

    Complete means every rank finished writing it (the callback's marker exists): a
    checkpoint cut short by a crash mid-save is skipped.
    """
    found = newest_marked(Path(output_dir), rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", "{name}/" + MARKER)
    return str(found) if found is not None else None


def set_global_batch(args: TrainingArguments, global_batch: int, *, world_sizes: tuple[int, ...] = ()) -> int:
    """Set ``args.gradient_accumulation_steps`` so the global batch is ``global_batch`` at
    ``args.world_size``; call before building the Trainer. Returns the steps.

    Raises :class:`GlobalBatchError` naming the world sizes (this one, or any of
    ``world_sizes``) that cannot keep it.
    """
    steps = accumulation_steps(
        global_batch=global_batch,
        per_device_batch=args.per_device_train_batch_size,
        world_size=args.world_size,
        world_sizes=world_sizes,
    )
    args.gradient_accumulation_steps = steps
    return steps


class ElasticOrderSampler(Sampler[int]):
    """Each epoch's global order, truncated to whole global batches, the same at every world size.

    The order is :func:`elastic_events.data.sampler.epoch_permutation` (``seed + epoch``);
    accelerate deals its batches out to the ranks, so step ``s`` trains samples
    ``[s*G, (s+1)*G)`` of it whatever the world size.
    """

    def __init__(self, num_samples: int, *, global_batch: int, seed: int, shuffle: bool = True) -> None:
        if num_samples < global_batch:
            raise GlobalBatchError(
                f"the dataset has {num_samples} samples, fewer than one global batch ({global_batch})"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of an epoch (whole global batches)."""
        return self.num_samples // self.global_batch

    def __len__(self) -> int:
        return self.num_samples - self.num_samples % self.global_batch

    def __iter__(self):
        order = epoch_permutation(self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return iter(order[: len(self)].tolist())


def _sampling_strategy(args: TrainingArguments) -> str:
    """``train_sampling_strategy`` (transformers 5), or its 4.x spelling ``group_by_length``."""
    legacy = "group_by_length" if getattr(args, "group_by_length", False) else "random"
    return getattr(args, "train_sampling_strategy", legacy)


def _global_batch(args: TrainingArguments) -> int:
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


class ElasticTrainerMixin(InPlaceTrainerMixin):
    """``class MyTrainer(ElasticTrainerMixin, Trainer)``: in-place scale events (with :func:`elastic_init` and
    :class:`ElasticCallback`), and any dataset length, each epoch cut to whole global batches."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Sampler | None:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        args = self.args
        if dataset is None or not hasattr(dataset, "__len__"):
            raise ElasticIntegrationError("elastic training needs a map-style train_dataset with a length")
        _check_strategy(args)
        return ElasticOrderSampler(
            len(dataset),
            global_batch=_global_batch(args),
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=_sampling_strategy(args) == "random",
        )


class ElasticTrainer(ElasticTrainerMixin, Trainer):
    """``Trainer`` that trains on in place through scale events, its epochs cut to whole global batches
    (see :class:`ElasticTrainerMixin`)."""


def _check_order(args: TrainingArguments, train_dataloader: Any, global_batch: int) -> None:
    """Refuse configurations whose data order would not continue exactly at another world size."""
    if args.ignore_data_skip:
        raise ElasticIntegrationError(
            "ignore_data_skip=True restarts the epoch's data order on resume; elastic training needs it False"
        )
    accelerator_config = args.accelerator_config  # an AcceleratorConfig once TrainingArguments.__post_init__ ran
    if isinstance(accelerator_config, AcceleratorConfig) and not accelerator_config.use_seedable_sampler:
        raise ElasticIntegrationError(
            "accelerator_config.use_seedable_sampler=False draws a new data order at every restart; keep it True"
        )
    dataset = getattr(train_dataloader, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ElasticIntegrationError("elastic training needs a map-style train_dataset with a length")
    if _find_sampler(train_dataloader, ElasticOrderSampler) is not None:
        return
    _check_strategy(args)
    if len(dataset) % global_batch:
        raise ElasticIntegrationError(
            f"the train dataset has {len(dataset)} samples, not a multiple of the global batch {global_batch}: the last "
            "steps of each epoch would differ between world sizes; use ElasticTrainer (or ElasticTrainerMixin), "
            "which trains each epoch in whole global batches, or trim the dataset"
        )


def _check_strategy(args: TrainingArguments) -> None:
    strategy = _sampling_strategy(args)
    if strategy not in _SUPPORTED_ORDERS:
        raise ElasticIntegrationError(
            f"train_sampling_strategy={strategy!r} orders samples by the world size; use one of {_SUPPORTED_ORDERS}"
        )


def _find_sampler(loader: Any, kind: type) -> Any:
    """The sampler of type ``kind`` under accelerate's wrappers of ``loader`` (a few levels), if any."""
    level = [loader]
    for _ in range(5):
        level = [getattr(n, a, None) for n in level for a in ("sampler", "batch_sampler")]
        level = [n for n in level if n is not None]
        for node in level:
            if isinstance(node, kind):
                return node
    return None


def _check_fsdp(args: TrainingArguments) -> None:
    if not args.fsdp:
        return
    fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}  # a dict after __post_init__
    kind = str(fsdp_config.get("state_dict_type", "FULL_STATE_DICT")).upper()
    if "LOCAL" in kind:
        raise ElasticIntegrationError(
            f"FSDP state_dict_type={kind} checkpoints load only at the world size that wrote them; use "
            "SHARDED_STATE_DICT (resharded by PyTorch DCP) or FULL_STATE_DICT"
        )


class ElasticCallback(TrainerCallback):
    """Act at the step hyperpodrun agrees on: go on in place (with :class:`ElasticTrainer`), or save
    and stop for a restart; resume at any world size.

    Args:
        global_batch: samples per optimizer step over all ranks. When given, the
            Trainer's per-device batch x accumulation x world size must equal it
            (see :func:`set_global_batch`); when None, it is whatever the first start
            had, and a resume with another product is refused.
        exit_on_event: after the save for a restart, or when this rank's node leaves the
            job in place, exit the process with status 0 at the end of ``train()`` (what
            the launcher expects). False: return from ``train()`` and let the script check
            :attr:`stopped_for_event`.
    """

    def __init__(self, *, global_batch: int | None = None, exit_on_event: bool = True) -> None:
        if global_batch is not None and (
            isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1
        ):
            raise GlobalBatchError(f"global_batch must be a positive int or None, got {global_batch!r}")
        self.global_batch = global_batch
        self.exit_on_event = exit_on_event
        self.stopped_for_event = False
        self.in_place = False  # ElasticTrainer offered in-place events for this rank
        self.resumed_in_place = False  # the next train() resumes from the state kept in memory
        self._in_place_event: Any = None  # the RECONFIGURE event the loop stopped for
        self._reseed_pending = False

    @property
    def in_place_event_pending(self) -> bool:
        """The Trainer's loop is stopping for an in-place event (``train()`` is about to return)."""
        return self._in_place_event is not None

    def take_in_place_event(self) -> Any:
        """The in-place event ``train()`` stopped for (None: it ended for another reason); taken once."""
        event, self._in_place_event = self._in_place_event, None
        return event

    # ------------------------------------------------------------------ start
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        global_batch = _global_batch(args)
        if self.global_batch is not None and global_batch != self.global_batch:
            raise GlobalBatchError(
                f"per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} x world size {args.world_size} = {global_batch}, not the global "
                f"batch {self.global_batch}; set it with set_global_batch(args, {self.global_batch}) before building "
                "the Trainer"
            )
        _check_order(args, kwargs.get("train_dataloader"), global_batch)
        _check_fsdp(args)
        self.stopped_for_event = False
        self._reseed_pending = False
        self._in_place_event = None
        if not self.in_place:  # under hyperpodrun: say once why events take the restart path
            rounds().offer(
                "transformers",
                ["the Trainer is not an ElasticTrainer (or ElasticTrainerMixin): in-place events need its train()"],
            )
        if self.resumed_in_place:  # from memory, after an in-place event: a new round, maybe a new world
            self.resumed_in_place = False
            self._reseed_pending = True
            return
        if state.global_step == 0:
            return
        marker = read_marker(_checkpoint_dir(args, state.global_step) / MARKER)
        if marker is None:
            return  # resumed from a checkpoint written without the callback: nothing more is known
        if marker.global_batch != global_batch:
            raise GlobalBatchError(
                f"the checkpoint at step {marker.step} was trained with global batch {marker.global_batch} at world "
                f"size {marker.world_size}; now it is {global_batch} at world size {args.world_size}: set "
                f"gradient_accumulation_steps with set_global_batch(args, {marker.global_batch})"
            )
        self._reseed_pending = marker.world_size != args.world_size
        eventlog.emit(Record.CHECKPOINT_LOADED, step=state.global_step, saved_world_size=marker.world_size)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        # The epoch of ElasticTrainer's order, from the step: when the Trainer resumes mid-epoch on several ranks,
        # it iterates a loader that skips the trained batches, and accelerate's set_epoch does not reach the order
        # through it (it sets two levels of samplers; this one is three levels down): epoch 0's order would be used.
        sampler = _find_sampler(kwargs.get("train_dataloader"), ElasticOrderSampler)
        if sampler is not None:
            sampler.set_epoch(state.global_step // sampler.steps_per_epoch)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if self._reseed_pending:  # after the Trainer restored what RNG it could, before the first step's forward
            reseed_rank(args.seed, state.global_step, args.process_index)
            self._reseed_pending = False

    # ------------------------------------------------------------------- stop
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not elastic_event_detected():
            return control
        event = rounds().take_event()
        control.should_training_stop = True
        if self.in_place and rounds().is_in_place(event):
            self._in_place_event = event  # nothing saved: ElasticTrainer.train carries the state into the new round
            return control
        control.should_save = True
        self.stopped_for_event = True
        if event is not None:
            rounds().restart_requested(event, step=state.global_step)
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has written its part (RNG, shards) of the checkpoint
        if state.is_world_process_zero:
            marker = ResumeMarker(
                step=state.global_step, world_size=args.world_size, global_batch=_global_batch(args), seed=args.seed
            )
            write_marker(_checkpoint_dir(args, state.global_step) / MARKER, marker)
            if self.stopped_for_event:
                eventlog.emit(
                    Record.CHECKPOINT_SAVED,
                    step=state.global_step,
                    path=str(_checkpoint_dir(args, state.global_step)),
                )

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not self.stopped_for_event and self._in_place_event is None:  # the end of training, not of a round
            rounds().finished(step=state.global_step)
        if self.stopped_for_event and self.exit_on_event and not self.in_place:  # ElasticTrainer.train exits itself
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            sys.exit(0)


def _checkpoint_dir(args: TrainingArguments, step: int) -> Path:
    if args.output_dir is None:
        raise ElasticIntegrationError("TrainingArguments.output_dir is not set: the Trainer's checkpoints go there")
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
