"""elastic_events: the training-script side of hyperpodrun.

This package never imports :mod:`hyperpodrun`. It talks to the launcher only
through the node-local control channel whose path the launcher puts in
``HYPERPODRUN_CONTROL_FILE``; under ``torchrun`` or as a plain script every call
here is a cheap no-op (``elastic_event_detected()`` returns False).

Typical loop, restart path (the launcher restarts every rank at the new size)::

    from elastic_events import elastic_event_detected

    for batch in loader:
        train_step(batch)
        if elastic_event_detected():   # True on every rank at the same step
            checkpointer.save(step, ...)
            return                     # the launcher restarts us at the new world size

Checkpointless path (ranks keep running through scale events and repairs; see
:class:`ElasticTraining` and ``docs/checkpointless.md``)::

    elastic = ElasticTraining(model_fn=..., optimizer_fn=..., sampler=sampler).start()
    for step in elastic.steps(loader, until=total_steps):
        with step:                     # a peer's failure here is repaired in place
            train_step(elastic.model, elastic.optimizer, step.batch)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from elastic_events import eventlog
from elastic_events.contract import Record, rank_context
from elastic_events.control import ControlChannelError, ControlReader, Event, EventKind

# Heavier parts load on first use (PEP 562), so `from elastic_events import elastic_event_detected`
# stays cheap; `from elastic_events import Checkpointer` works all the same.
_LAZY = {
    "Checkpointer": "elastic_events.checkpoint",
    "CheckpointConfig": "elastic_events.checkpoint",
    "CheckpointError": "elastic_events.checkpoint",
    "ElasticSampler": "elastic_events.data.sampler",
    "BatchPlan": "elastic_events.data.batching",
    "plan_global_batch": "elastic_events.data.batching",
    "loss_scale": "elastic_events.data.batching",
    "global_token_count": "elastic_events.data.batching",
    "TokenDataset": "elastic_events.data.dataset",
    "ByteTokenizer": "elastic_events.data.dataset",
    "build_token_dataset": "elastic_events.data.dataset",
    "load_scale_config": "elastic_events.scale_config",
    "ElasticTraining": "elastic_events.training",
    "ElasticConfig": "elastic_events.rounds.config",
    "HSDPConfig": "elastic_events.rounds.mesh",
    "MeshLayoutError": "elastic_events.rounds.mesh",
    "Step": "elastic_events.training",
    "RoundEngine": "elastic_events.rounds.engine",
    "ElasticTrainingError": "elastic_events.errors",
    "HydrationError": "elastic_events.errors",
    "StateMismatchError": "elastic_events.errors",
    "GroupError": "elastic_events.errors",
    "init_process_group": "elastic_events.rounds.group",
    "clip_grad_norm_": "elastic_events.grad_norm",
    "state_will_be_loaded": "elastic_events.state_loading",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elastic_events' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "ControlChannelError",
    "Event",
    "EventKind",
    "current_event",
    "elastic_event_detected",
    "is_elastic",
    "leave_on_sigterm",
    "restart_reason",
]


class _FirstStep:
    """Stands in for the reader until the first step of a round: logs ``first_step``, then steps aside."""

    def __init__(self, reader: ControlReader, reason: str) -> None:
        self.reader, self.reason = reader, reason

    def check(self) -> bool:
        global _reader
        _reader = self.reader
        fired = self.reader.check()
        eventlog.emit(Record.FIRST_STEP, reason=self.reason)
        return fired

    def event(self) -> Event | None:
        return self.reader.event()


_reader: ControlReader | _FirstStep | None = None
_probed = False
_step_hook: Callable[[], None] | None = None  # ElasticTraining's snapshot of the step just ended


def _probe() -> ControlReader | _FirstStep | None:
    """Open the control channel once, on first use (no import-time side effects).

    The first call of ``elastic_event_detected()`` marks the end of the round's first
    step: rank 0 logs ``first_step``.
    """
    global _reader, _probed
    _probed = True
    ctx = rank_context()
    if ctx.control_file is not None:
        _reader = _FirstStep(ControlReader(Path(ctx.control_file), ctx.local_rank), restart_reason())
        _register_stack_dump()
        from elastic_events import termination  # SIGTERM: a request to leave the job (Slurm signals every process)

        termination.install(_reader.reader)
    return _reader


STACK_DUMP_SIGNAL = "SIGUSR1"


def _register_stack_dump() -> None:
    """Under hyperpodrun, SIGUSR1 writes every thread's Python stack to stderr (the rank's log):
    the agent sends it to a rank that made no progress for ``--hang-timeout`` seconds."""
    import faulthandler
    import signal

    signum = getattr(signal, STACK_DUMP_SIGNAL, None)
    if signum is not None and signal.getsignal(signum) in (signal.SIG_DFL, None):
        faulthandler.register(signum, all_threads=True, chain=False)


def _channel() -> ControlReader | None:
    """The control channel's reader for the in-process API (None outside hyperpodrun)."""
    reader = _reader if _probed else _probe()
    return reader.reader if isinstance(reader, _FirstStep) else reader


def _new_round(reason: str) -> None:
    """The next ``elastic_event_detected()`` ends the first step of a new round: log it."""
    global _reader
    reader = _channel()
    if reader is not None:
        _reader = _FirstStep(reader, reason)


def elastic_event_detected() -> bool:
    """True once per scale event, at the step where every rank of the job acts on it.

    Acting means :meth:`ElasticTraining.reconfigure` (in place, or save and exit when
    the launcher asks for a restart), or, without that API, saving and exiting.
    Call it once per training step on every rank. It costs two memory operations
    on a node-local shared-memory page (well under a microsecond of work; see
    ``benchmarks/step_overhead.py``) and never a collective. Outside hyperpodrun
    it always returns False. With a sharded model under :class:`ElasticTraining` it also
    starts the in-memory snapshot of the step that just ended (:mod:`elastic_events.rounds.snapshot`:
    the bytes are sent in the background; call it after the step's bookkeeping).
    """
    if _step_hook is not None:
        _step_hook()
    reader = _reader
    if reader is None:
        if _probed:
            return False
        reader = _probe()
        if reader is None:
            return False
    return reader.check()


def _set_step_hook(hook: Callable[[], None] | None) -> None:
    """What ``elastic_event_detected()`` runs first: the in-process API's snapshot of the step that just ended."""
    global _step_hook
    _step_hook = hook


def current_event() -> Event | None:
    """The pending event (id, target step, kind, round, new world size), or None."""
    reader = _reader if _probed else _probe()
    return reader.event() if reader is not None else None


def leave_on_sigterm() -> bool:
    """Under hyperpodrun, make SIGTERM a request to leave the job at the next agreed step (see
    :mod:`elastic_events.termination`); whether it is one now. Call it at the top of a script, before
    its data loader starts workers: they then outlive a SIGTERM meant for the job (Slurm signals every
    process of a job step). ``ElasticTraining.start()`` and the first ``elastic_event_detected()`` do it too."""
    from elastic_events import termination

    return _channel() is not None and termination.state() is termination.GuardState.WATCHING


def is_elastic() -> bool:
    """Whether this process was started by hyperpodrun (and so may see elastic events)."""
    return rank_context().under_hyperpodrun


def restart_reason() -> str:
    """Why this process was started: ``start``, ``scale`` or ``failure`` (``start`` outside hyperpodrun)."""
    return rank_context().restart_reason.value
