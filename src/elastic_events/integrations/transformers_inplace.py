"""In-place scale events for ``transformers.Trainer``: the half of :class:`~.transformers.ElasticTrainerMixin`
that keeps the ranks' processes through a world-size change.

At a ``RECONFIGURE`` event :class:`~.transformers.ElasticCallback` stops the Trainer's loop at
the agreed step without saving; ``train()`` returns with the model, the optimizer's state,
the LR scheduler and the :class:`~transformers.TrainerState` in memory.
:meth:`InPlaceTrainerMixin.train` then

* drops what belongs to the old world: accelerate's DDP wrapper and prepared objects
  (``Accelerator.free_memory``), the persistent evaluation loaders;
* has :mod:`elastic_events.integrations.inplace` tear the old group down, join the new
  round's and bring the newcomers to the survivors' state (model tensors, the optimizer's
  state dict, scheduler, scaler, trainer state: from a survivor, in memory);
* rebuilds the Trainer's world: accelerate's ``PartialState`` for the new group
  (``TrainingArguments`` caches it), gradient accumulation for the constant global batch,
  a new ``Accelerator`` (``create_accelerator_and_postprocess``);
* calls ``Trainer.train`` again, resuming from the in-memory state through the Trainer's own
  resume path: ``trainer_state.json`` (written to a private node-local directory: global step,
  epoch, logs) drives the data skip exactly as a checkpoint would; the loads of weights,
  optimizer, scheduler, scaler and RNG are served from memory.

A newcomer (a pre-warmed joiner admitted by :func:`~.inplace.elastic_init`) receives the state
in its first ``train()`` and resumes the same way. A leaving rank's ``train()`` exits 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.trainer_utils import TrainOutput

from elastic_events.integrations import inplace
from elastic_events.integrations.common import GlobalBatchError, accumulation_steps
from elastic_events.rounds.group import teardown_group

if TYPE_CHECKING:  # the mixin is used only in a Trainer subclass: checked as one, a plain class at run time
    from torch import nn
    from transformers import Trainer as _TrainerBase

    from elastic_events.integrations.transformers import ElasticCallback
else:
    _TrainerBase = object

__all__ = ["InPlaceTrainerMixin"]

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


def _memory_root() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def in_place_blockers(trainer: Any) -> list[str]:
    """What in the Trainer's configuration prevents in-place events (empty: nothing)."""
    why = []
    if trainer.is_deepspeed_enabled:
        why.append("DeepSpeed: its engine and ZeRO partitions are not rebuilt in place")
    if trainer.is_fsdp_enabled:
        why.append(
            "FSDP: accelerate's sharded model and optimizer are not re-sharded in place (the restart path "
            "reshards the Trainer's checkpoint)"
        )
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        why.append("a model sharded at load time (tensor parallel) is not re-sharded in place")
    if trainer.model_init is not None:
        why.append("model_init: the Trainer builds a new model at every train()")
    if trainer.args.auto_find_batch_size:
        why.append("auto_find_batch_size changes the per-device batch, and so the global batch, while training")
    if getattr(trainer, "is_model_parallel", False) or trainer.args.n_gpu > 1:
        why.append("a model split over devices, or DataParallel over several GPUs of one process")
    return why


def _combined(outputs: list[tuple[TrainOutput, int]]) -> TrainOutput:
    """One ``TrainOutput`` for the segments this process trained: loss averaged over their steps."""
    if len(outputs) == 1:
        return outputs[0][0]
    steps = sum(n for _, n in outputs)
    loss = sum(out.training_loss * n for out, n in outputs) / max(steps, 1)
    last = outputs[-1][0]
    return TrainOutput(last.global_step, loss, {**last.metrics, "train_loss": loss})


class InPlaceTrainerMixin(_TrainerBase):
    """``Trainer.train`` that goes on in the same process through in-place scale events (see module doc)."""

    _elastic_memory: dict[str, Any] | None = None  # the state the next train() resumes from, in memory
    _elastic_memory_dir: str | None = None  # where its trainer_state.json is

    def _elastic_callback(self) -> ElasticCallback | None:
        from elastic_events.integrations.transformers import ElasticCallback

        found = [cb for cb in self.callback_handler.callbacks if isinstance(cb, ElasticCallback)]
        return found[0] if found else None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """``Trainer.train``; under hyperpodrun, with :func:`elastic_init` called, in-place scale events too."""
        base = super().train
        callback = self._elastic_callback()
        rounds = inplace.rounds()
        blockers = (
            in_place_blockers(self) if callback is not None else ["no ElasticCallback among the Trainer's callbacks"]
        )
        if not rounds.offer("transformers", blockers) or callback is None:  # no callback: a blocker, not offered
            return base(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        callback.in_place = True
        args = self.args
        global_batch = (
            callback.global_batch
            or args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )
        resume = resume_from_checkpoint
        if rounds.admitted:
            resume = self._elastic_resume(
                rounds, rounds.admitted_state(module=self._elastic_module()), callback, global_batch, resume
            )
        outputs: list[tuple[TrainOutput, int]] = []
        while True:
            try:
                out = base(
                    resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
                )
            finally:
                self._elastic_memory = None
            outputs.append((out, out.global_step - getattr(self, "_initial_global_step", 0)))
            event = callback.take_in_place_event()
            if event is None:
                if callback.stopped_for_event and callback.exit_on_event:  # saved for a restart: exit 0, cleanly
                    self._elastic_drop_world()
                    teardown_group()
                    sys.exit(0)
                return _combined(outputs)
            kept = self._elastic_keep(global_batch)
            moved = rounds.move(event, kept=kept, module=self._elastic_module())
            if moved.left:
                callback.stopped_for_event = True
                if callback.exit_on_event:
                    sys.exit(0)
                return _combined(outputs)
            resume = self._elastic_resume(rounds, moved, callback, global_batch, None)

    # ------------------------------------------------------------- at an event
    def _elastic_module(self) -> nn.Module:
        """The Trainer's model, whose tensors travel between rounds (the Trainer has one: model_init is a blocker)."""
        if self.model is None:
            raise inplace.InPlaceError("the Trainer has no model to carry into the new round")
        return self.model

    def _elastic_keep(self, global_batch: int) -> inplace.Kept:
        """The state to carry into the next round (referenced, not copied), and the old world's objects dropped."""
        self._elastic_drop_world()
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        scaler = getattr(self.accelerator, "scaler", None)
        payload = {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "trainer_state": json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
            "global_batch": global_batch,
            "world_size": self.args.world_size,
        }
        return inplace.Kept(step=self.state.global_step, payload=payload)

    def _elastic_drop_world(self) -> None:
        """Let go of what belongs to the current process group: the DDP wrapper holds it (and, left alive, is
        freed during interpreter finalization, where torch's gloo can abort or hang the exit)."""
        from accelerate.optimizer import AcceleratedOptimizer
        from accelerate.scheduler import AcceleratedScheduler

        while isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer = self.optimizer.optimizer
        while isinstance(self.lr_scheduler, AcceleratedScheduler):
            self.lr_scheduler = self.lr_scheduler.scheduler
        model = self._elastic_module()
        wrapper = self.model_wrapped if self.model_wrapped is not model else None
        self.model_wrapped = model
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        handler.train_dataloader = None
        alive = weakref.ref(wrapper) if wrapper is not None else None
        del wrapper
        self.accelerator.free_memory()  # its prepared model, optimizer, loaders; collects
        if alive is not None and alive() is not None:
            gc.collect()
        if hasattr(self, "_eval_dataloaders"):  # persistent workers' evaluation loaders, split for the old world
            del self._eval_dataloaders

    def _elastic_world(self, global_batch: int) -> None:
        """Rebuild what the Trainer binds to the world for the round's group (a survivor's; a joiner built them in it)."""
        args = self.args
        args.__dict__.pop("_setup_devices", None)  # cached_property: accelerate's PartialState of the old group
        _ = args.device  # a fresh PartialState: the new group is up, so nothing is initialised twice
        args.gradient_accumulation_steps = accumulation_steps(
            global_batch=global_batch, per_device_batch=args.per_device_train_batch_size, world_size=args.world_size
        )
        self.create_accelerator_and_postprocess()

    def _elastic_resume(
        self,
        rounds: inplace.Rounds,
        moved: inplace.Moved,
        callback: ElasticCallback,
        global_batch: int,
        fallback: str | bool | None,
    ) -> str | bool | None:
        """Make the next train() resume from ``moved``'s state; mark the rank READY. Returns its ``resume_from_checkpoint``."""
        try:
            if moved.survivor:
                self._elastic_world(global_batch)
            if moved.payload is None:  # no rank held the state (all were replaced after a failure): storage
                resume = fallback
            else:
                if moved.payload["global_batch"] != global_batch:
                    raise GlobalBatchError(
                        f"the job trains with global batch {moved.payload['global_batch']}, this rank with {global_batch}: "
                        "every rank must use the same ElasticCallback(global_batch=...) and set_global_batch"
                    )
                resume = self._elastic_memory_checkpoint(moved.payload)
                callback.resumed_in_place = True
        except BaseException:
            rounds.failed()
            raise
        rounds.ready(moved)
        return resume

    def _elastic_memory_checkpoint(self, payload: dict[str, Any]) -> str:
        """A directory holding only ``trainer_state.json``; everything else is served from ``payload``."""
        if self._elastic_memory_dir is None:
            path = tempfile.mkdtemp(prefix=f"hyperpodrun-inplace-{os.getpid()}-", dir=_memory_root())
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            self._elastic_memory_dir = os.path.abspath(path)
        Path(self._elastic_memory_dir, TRAINER_STATE).write_text(payload["trainer_state"])
        self._elastic_memory = payload
        return self._elastic_memory_dir

    # ------------------------------------------- the Trainer's resume, from memory
    def _in_memory(self, checkpoint: Any) -> dict[str, Any] | None:
        """The state in memory when ``checkpoint`` is its directory, else None."""
        memory = self._elastic_memory
        if isinstance(checkpoint, (str, os.PathLike)) and os.path.abspath(checkpoint) == self._elastic_memory_dir:
            return memory
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._in_memory(resume_from_checkpoint) is not None:
            return  # the module holds the weights: its own (a survivor) or received from one (a joiner)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        memory = self._in_memory(checkpoint)
        if memory is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if memory["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(memory["optimizer"])
        if memory["scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(memory["scheduler"])
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        memory = self._in_memory(checkpoint)
        if memory is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and memory["scaler"] is not None:
            scaler.load_state_dict(memory["scaler"])
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._in_memory(checkpoint) is None:
            return super()._load_rng_state(checkpoint)
        return None  # ElasticCallback reseeds every rank from (seed, step, rank) before the first step

    def _load_callback_state(self) -> None:
        if self._elastic_memory is not None:
            return  # survivors keep their callbacks' live state; a joiner starts them fresh
        super()._load_callback_state()

    def _load_best_model(self) -> None:
        callback = self._elastic_callback()
        if callback is not None and callback.in_place_event_pending:
            return  # training goes on in place: the best model is loaded when it really ends
        super()._load_best_model()
