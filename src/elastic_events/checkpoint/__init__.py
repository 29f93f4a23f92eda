"""Durable checkpoints: PyTorch DCP written at an agreed step, loaded resharded to any world size.

:mod:`.checkpointer` holds the :class:`Checkpointer` (save, load, prune, verify); :mod:`.layout`
the on-disk layout and the small state beside the tensors; :mod:`.comm` the collectives a save
and a load use (a side gloo group, or none in a single process).
"""

from elastic_events.checkpoint.checkpointer import (
    MARKER_NAME,
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWarning,
    IncompatibleCheckpointError,
    LoadedState,
    SharedStorageError,
    list_checkpoints,
    verify_checkpoint,
)

__all__ = [
    "MARKER_NAME",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CheckpointWarning",
    "Checkpointer",
    "IncompatibleCheckpointError",
    "LoadedState",
    "SharedStorageError",
    "list_checkpoints",
    "verify_checkpoint",
]
