"""Durable checkpoints: PyTorch DCP written at an agreed step, loaded resharded to any world size.

:mod:`.checkpointer` holds the :class:`Checkpointer` (save, load, prune, verify) and is what this
package exports; :mod:`.layout` the on-disk layout and the small state beside the tensors; :mod:`.comm`
the collectives a save and a load use (a side gloo group, or none in a single process).
"""

from elastic_events.checkpoint import checkpointer as _checkpointer
from elastic_events.checkpoint.checkpointer import *  # noqa: F403

__all__ = list(_checkpointer.__all__)
