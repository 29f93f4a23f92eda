"""Below the job's minimum: save, then hold the state in memory until nodes join or this node leaves.

When too few nodes survive a scale event or a failure for the job to train, the launcher moves the
survivors in place into a *held* round (``Event.hold``; the launcher side is
``hyperpodrun.rendezvous.hold``). :func:`hold` runs there, in :meth:`ElasticTraining.reconfigure`
or :meth:`~ElasticTraining.recover`, right after the rank joined that round:

1. the survivors save a checkpoint together (the durable copy; skipped when this step is saved);
2. rank 0 says which step is held and where the checkpoint is;
3. every rank waits (phase ``HOLDING``), its group up and its state in memory, for the next event:
   nodes joining (the rank moves in place into their round and newcomers are hydrated from it, then
   training resumes at the held step), this node leaving (the state stays saved), or fewer survivors
   holding on (back to 1).

Returns True when the rank trains on (rebuild the loader iterator), False when it leaves the job.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from elastic_events import eventlog
from elastic_events.contract import Record
from elastic_events.control import CAP_HOLD, AdmissionTimeoutError, RankPhase
from elastic_events.errors import ElasticTrainingError

if TYPE_CHECKING:
    from elastic_events.training import ElasticTraining

__all__ = ["CAP_HOLD", "HoldTimeoutError", "STATE_HELD", "hold"]

#: The trainer record of a hold (in the launcher's event log): step, world size, checkpoint directory.
STATE_HELD = Record.STATE_HELD

#: How often a holding rank looks at the control channel: a hold lasts minutes, its end costs this at most.
HOLD_POLL_S = 0.05


class HoldTimeoutError(ElasticTrainingError, TimeoutError):
    """No node joined and nobody asked this rank to leave within ``ElasticConfig.admission_timeout_s``."""


def hold(training: ElasticTraining) -> bool:
    """Hold the state of ``training``, just moved into a held round; see the module's docstring."""
    try:
        while True:
            where = _save(training)
            if training.is_main:
                print(
                    f"below the job's minimum (world {training.world_size}): holding step {training.step} in "
                    f"memory; {where}; nodes that join resume it in place",
                    flush=True,
                )
            eventlog.emit(STATE_HELD, step=training.step, world_size=training.world_size, checkpoint=where)
            reader = training.engine.reader
            if reader is None:
                raise ElasticTrainingError("a held round needs the launcher's control channel")
            try:
                nxt = reader.wait_for_reconfigure(
                    RankPhase.HOLDING,
                    timeout_s=training.config.admission_timeout_s,
                    poll_s=max(training.config.poll_s, HOLD_POLL_S),
                    what=f"rank {training.rank} held step {training.step} below the job's minimum and no node joined",
                )
            except AdmissionTimeoutError as exc:
                raise HoldTimeoutError(str(exc)) from None
            if nxt.leaves and nxt.world_size < 0:  # every holding node leaves: nothing to hand on, it is saved
                training.engine.set_phase(RankPhase.LEAVING)
                return False
            training.engine.set_phase(RankPhase.RECONFIGURING)
            if not training._move(nxt):
                return False
            if not nxt.hold:
                return True
    except BaseException:
        training.engine.set_phase(RankPhase.FAILED)
        raise


def _save(training: ElasticTraining) -> str:
    """Save the held step (collective in the held round); where it is, for rank 0's line."""
    ckpt = training.checkpointer
    if ckpt is None:
        print(f"rank {training.rank}: no checkpointer: the held state exists in memory only", file=sys.stderr)
        return "no checkpointer: in memory only"
    if training._saved_step != training.step:
        training.save_checkpoint()
    ckpt.wait()
    return f"checkpoint of step {training.step} in {getattr(getattr(ckpt, 'config', None), 'dir', 'its checkpointer')}"
