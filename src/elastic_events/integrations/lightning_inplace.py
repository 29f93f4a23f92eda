"""In-place scale events for a Lightning ``Trainer`` (DDP): :meth:`ElasticCallback.fit <.lightning.ElasticCallback.fit>`.

At a ``RECONFIGURE`` event :class:`~.lightning.ElasticCallback` takes, at the agreed step and
in the place where the restart path saves its checkpoint, the same Lightning checkpoint in
memory (``dump_checkpoint``: optimizers, schedulers, loops, callbacks; tensors referenced, not
copied) and stops ``fit``. :func:`fit` then

* has :mod:`elastic_events.integrations.inplace` tear the old group down (Lightning's strategy
  has already dropped its DDP wrapper in its teardown), join the new round's group and bring
  the newcomers to the survivors' state: the model's tensors into their own, the rest of
  the checkpoint dict from a survivor, in memory;
* points the strategy at the new world (its ``num_nodes``; ranks and world size are read from
  the round's environment by ``TorchElasticEnvironment``), and serves the checkpoint from
  memory through a ``CheckpointIO`` plugin wrapping the strategy's own;
* calls ``trainer.fit`` again with that checkpoint: Lightning restores model, optimizers,
  schedulers, loops and callbacks as from a file, wraps the model in DDP over the new group
  and trains on; the callback re-splits its sampler over the new world and recounts the
  epoch's batch counters for the new accumulation, as after a restart.

A newcomer (a pre-warmed joiner admitted by :func:`~.inplace.elastic_init`) receives the state in
its first :func:`fit` and resumes the same way. A leaving rank's :func:`fit` exits 0.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # checked against the unified package; the standalone one has the same classes
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
else:
    try:
        from lightning.fabric.plugins import CheckpointIO
        from lightning.fabric.plugins.environments import TorchElasticEnvironment
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    except ImportError:  # the standalone package
        from lightning_fabric.plugins import CheckpointIO
        from lightning_fabric.plugins.environments import TorchElasticEnvironment
        from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from elastic_events.integrations import inplace
from elastic_events.rounds.group import teardown_group

__all__ = ["MEMORY_CHECKPOINT", "fit", "in_place_blockers"]

#: The ``ckpt_path`` of a checkpoint served from memory (never a file).
MEMORY_CHECKPOINT = "hyperpodrun-memory://elastic-step={step}.ckpt"


class _MemoryCheckpointIO(CheckpointIO):
    """The strategy's own ``CheckpointIO``, except that one path is served from a dict in memory (once)."""

    def __init__(self, base: CheckpointIO, path: str, checkpoint: dict[str, Any]) -> None:
        self.base, self.path = base, path
        self._checkpoint: dict[str, Any] | None = checkpoint  # None once served

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.base.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if str(path) == self.path and self._checkpoint is not None:
            checkpoint, self._checkpoint = self._checkpoint, None
            return checkpoint
        return self.base.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.base.remove_checkpoint(path)

    def teardown(self) -> None:
        self.base.teardown()


def in_place_blockers(trainer: Any, model: Any) -> list[str]:
    """What prevents in-place events for this ``fit`` (empty: nothing)."""
    why = []
    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
        why.append(f"strategy {type(strategy).__name__}: only DDP ('ddp') is rebuilt in place")
    elif getattr(strategy, "_start_method", "popen") != "popen":
        why.append("a DDP strategy that spawns its own processes: hyperpodrun starts the ranks")
    elif not isinstance(strategy.cluster_environment, TorchElasticEnvironment):
        why.append(
            f"cluster environment {type(strategy.cluster_environment).__name__}: ranks are not read from the launcher's variables"
        )
    if model is None:
        why.append("fit() without the LightningModule: in-place events need the model to carry")
    return why


def fit(callback: Any, trainer: Any, model: Any, fit_args: dict[str, Any], ckpt_path: Any) -> None:
    """``trainer.fit(model, **fit_args, ckpt_path=...)``, carried through in-place events (see module doc)."""
    rounds = inplace.rounds()
    if not rounds.offer("lightning", in_place_blockers(trainer, model)):
        trainer.fit(model, **fit_args, ckpt_path=ckpt_path)
        return
    callback.in_place = True
    if rounds.admitted:
        ckpt_path = _resume(rounds, rounds.admitted_state(module=model), callback, trainer, model, ckpt_path)
    while True:
        base = trainer.strategy.checkpoint_io
        memory = callback.memory_checkpoint
        if memory is not None:
            trainer.strategy.checkpoint_io = _MemoryCheckpointIO(base, ckpt_path, memory)
        callback.memory_checkpoint = None
        try:
            trainer.fit(model, **fit_args, ckpt_path=ckpt_path)
        finally:
            if memory is not None:
                trainer.strategy.checkpoint_io = base
        event = callback.take_in_place_event()
        if event is None:
            if callback.stopped_for_event and callback.exit_on_event:  # saved for a restart: exit 0, cleanly
                gc.collect()  # the strategy's teardown dropped its DDP wrapper; let it free the group first
                teardown_group()
                sys.exit(0)
            return
        kept = inplace.Kept(step=trainer.global_step, payload=callback.take_kept_checkpoint())
        moved = rounds.move(event, kept=kept, module=model)
        if moved.left:
            callback.stopped_for_event = True
            if callback.exit_on_event:
                sys.exit(0)
            return
        ckpt_path = _resume(rounds, moved, callback, trainer, model, None)


def _resume(
    rounds: inplace.Rounds, moved: inplace.Moved, callback: Any, trainer: Any, model: Any, fallback: Any
) -> Any:
    """Point the strategy at the new round and the next ``fit`` at the in-memory checkpoint; mark the rank READY."""
    try:
        strategy = trainer.strategy
        strategy.num_nodes = int(
            os.environ.get("GROUP_WORLD_SIZE", "1")
        )  # ranks and world: from the round's environment
        strategy._configure_launcher()  # its launcher checks devices x num_nodes against the world at every fit
        if moved.payload is None:  # no rank held the state (all were replaced after a failure): storage
            path = fallback
        else:
            checkpoint = dict(moved.payload)
            checkpoint["state_dict"] = model.state_dict()  # the module's own tensors: kept, or just received
            path = MEMORY_CHECKPOINT.format(step=checkpoint.get("global_step", 0))
            callback.memory_checkpoint = checkpoint
            callback.resumed_in_place = True
    except BaseException:
        rounds.failed()
        raise
    rounds.ready(moved)
    return path
