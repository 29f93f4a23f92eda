"""Atomic, resharding checkpoints on PyTorch Distributed Checkpoint (DCP).

One :class:`Checkpointer` saves and loads everything a step needs: model (plain, DDP
or FSDP2 ``fully_shard``), optimizer, LR scheduler, data position, step, RNG state
and user extras. A load reshards to the current world size. Layout under ``dir``::

    step_000000120/                 complete: only ever created by a rename
        .metadata  __0_0.distcp  __1_0.distcp  COMPLETE (JSON: step, world size, time, torch)
    step_000000130.tmp-1f2e3d4c/    a save in progress, or one that crashed: never loaded

Save protocol: all ranks write into a fresh ``.tmp-<token>`` directory (token from
rank 0); DCP's coordinator writes ``.metadata`` after every rank has written; rank 0
checks that each shard file named there is on disk at full length (so it sees the
other ranks' files), writes ``COMPLETE``, renames the directory to ``step_<N>``, and
only then prunes old checkpoints; finally every rank confirms it sees the result.

What is saved, per kind of state:

* model and optimizer: DCP state dicts from ``get_state_dict`` (FQN keys, sharded for
  FSDP2, deduplicated for replicated DDP tensors), resharded on load;
* scheduler, data position, extras and step: *global* state, the same on every rank by
  contract (e.g. :class:`~elastic_events.data.sampler.ElasticSampler`'s global position);
  rank 0's copy is written and every rank loads it;
* RNG: each rank's own generators. At the saved world size every rank gets its own
  stream back; at another size every rank re-seeds from
  ``derive_rank_seed(rank 0's base seed, step, rank)`` (see :mod:`elastic_events.rng`).

Async save (``async_save=True``) returns once DCP has copied the state to CPU memory
and writes it from a background thread; rank 0 commits as soon as the write is done.
Training resumes sooner, at the cost of a second CPU copy of the state until written,
a newest checkpoint that is not durable yet when ``save`` returns, and storage errors
that surface only in :meth:`Checkpointer.wait` (called by the next ``save``, ``load``
and ``close``). Call ``wait`` before exiting on purpose, e.g. at a scale event.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elastic_events import eventlog
from elastic_events.checkpoint import partials
from elastic_events.checkpoint.comm import Comm, GroupComm, quiet_single_process
from elastic_events.checkpoint.layout import (
    _METADATA,
    MARKER_NAME,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWarning,
    IncompatibleCheckpointError,
    SharedStorageError,
    _describe,
    _from_bytes,
    _fsync_dir,
    _read_metadata,
    _scan,
    _shard_problems,
    _to_bytes,
    _write_marker,
    list_checkpoints,
    prepare_directory,
    prune,
    recover_interrupted,
    remove_abandoned,
    verify_checkpoint,
)
from elastic_events.contract import Record
from elastic_events.rng import (
    capture_rng_state,
    derive_rank_seed,
    restore_rng_state,
    rng_from_plain,
    rng_to_plain,
    seed_all,
)
from elastic_events.rounds import abort

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

logger = logging.getLogger(__name__)

_GLOBAL_KEY = "global"
_FULL_BELOW = 1 << 20  # bytes
_RngOutcome = Literal["restored", "reseeded"]


# --------------------------------------------------------------------------- data


def _space_hint(path: Path) -> str:
    """Why a write failed when the file system is full (torch's own error may not say)."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return ""
    return f" (the file system of {path.parent} is full: {free} bytes free)" if free < _FULL_BELOW else ""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written.

    ``dir`` must be on storage shared by every node. ``keep_last=None`` keeps all.
    ``timeout_s`` bounds every wait: cross-rank agreement, async writes and commits.
    """

    dir: Path
    keep_last: int | None = 3
    async_save: bool = False
    timeout_s: float = 600.0
    sync_files: bool = True
    io_threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise ValueError(f"dir must be a non-empty path, got {self.dir!r}")
        object.__setattr__(self, "dir", Path(self.dir))
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValueError(f"keep_last must be None or an integer >= 1, got {self.keep_last!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save must be a bool, got {self.async_save!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"io_threads must be an integer >= 1, got {self.io_threads!r}")


@dataclass(frozen=True, kw_only=True)
class LoadedState:
    """The result of a successful :meth:`Checkpointer.load`."""

    info: CheckpointInfo
    step: int
    world_size: int
    """The world size loaded into; ``info.world_size`` is the one it was saved at."""
    extra: dict[str, Any]
    rng: _RngOutcome
    """``restored``: this rank's own generators; ``reseeded``: the world size changed."""
    skipped: tuple[Path, ...] = ()
    """Newer checkpoints that were unusable, each reported with a :class:`CheckpointWarning`."""

    @property
    def resharded(self) -> bool:
        return self.world_size != self.info.world_size


# ------------------------------------------------------------------- checkpointer


@dataclass(frozen=True)
class _Targets:
    """The live objects one save reads from or one load writes into."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None
    data: Stateful | None

    def components(self) -> tuple[str, ...]:
        return ("model", *(n for n in ("optimizer", "scheduler", "data") if getattr(self, n) is not None))

    def tensor_state(self) -> dict[str, Any]:
        """DCP state dicts (FQN keys, sharded as the module is): the save source or load template."""
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_tensor_state(self, state: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )

    def global_state(self) -> dict[str, Any]:
        return {n: None if (obj := getattr(self, n)) is None else obj.state_dict() for n in ("scheduler", "data")}

    def load_global_state(self, saved: dict[str, Any]) -> None:
        for name in ("scheduler", "data"):
            if (obj := getattr(self, name)) is not None:
                obj.load_state_dict(saved[name])


@dataclass(kw_only=True)
class _PendingSave:
    info: CheckpointInfo
    tmp: Path
    future: concurrent.futures.Future[Any] | None = None
    committed: threading.Event = field(default_factory=threading.Event)
    commit_error: CheckpointError | None = None


class Checkpointer:
    """Saves and loads a job's full training state; see the module docstring.

    When ``torch.distributed`` is initialised, every method but :meth:`latest` is
    collective: all ranks call it, with the same arguments. Ranks agree over
    ``process_group`` if given (with async saves it must not be the group training
    collectives use), else over a gloo group created on first use.
    """

    def __init__(self, config: CheckpointConfig, *, process_group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self._group = process_group
        self._comm: Comm | None = None
        self._comm_world: Any = None
        self._pending: _PendingSave | None = None
        prepare_directory(config.dir)

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint with a marker (local and cheap; :meth:`load` verifies fully)."""
        recover_interrupted(self.config.dir)
        found = list_checkpoints(self.config.dir)
        return found[0] if found else None

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data: Stateful | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Checkpoint ``step``; return the directory it has once complete.

        ``extra``: small picklable values (tensors included), global like ``data``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict, got {type(extra).__name__}")
        self.wait()
        comm = self._get_comm()
        token = comm.broadcast(secrets.token_hex(4) if comm.rank == 0 else None, what=f"name step {step}'s directory")
        final = self.config.dir / f"step_{step:09d}"
        tmp = final.with_name(f"{final.name}.tmp-{token}")
        targets = _Targets(model, optimizer, scheduler, data)
        state = self._state_to_save(step, comm, targets, extra)
        components = targets.components() + (("extra",) if extra is not None else ())
        info = CheckpointInfo(
            step=step,
            path=final,
            world_size=comm.world_size,
            saved_at=time.time(),
            torch_version=torch.__version__,
            components=components,
        )
        pending = _PendingSave(info=info, tmp=tmp)
        writer = FileSystemWriter(tmp, sync_files=self.config.sync_files, thread_count=self.config.io_threads)
        try:
            if comm.rank == 0:
                remove_abandoned(self.config.dir)  # a crashed save's space back before this one needs it
                partials.claim(tmp)
            with quiet_single_process(comm):
                if self.config.async_save:
                    result = dcp.async_save(state, storage_writer=writer, **comm.dcp_kwargs)
                    # a future of the whole save, or (newer torch) an AsyncSaveResponse whose upload is the save
                    if isinstance(result, concurrent.futures.Future):
                        pending.future = result
                    else:
                        pending.future = result.upload_completion
                else:
                    dcp.save(state, storage_writer=writer, **comm.dcp_kwargs)
        except (Exception, CheckpointException) as exc:
            hint = _space_hint(tmp)
            if comm.rank == 0:
                partials.remove(tmp)  # a failed save gives its space back (a full disk that clears works again)
            raise CheckpointError(f"writing step {step} to {tmp} failed: {_describe(exc)}{hint}") from exc
        if pending.future is None:
            if comm.rank == 0:
                self._commit(pending)
            self._confirm(pending, comm)
        else:
            if comm.rank == 0:
                pending.future.add_done_callback(lambda future: self._commit(pending, future))
            self._pending = pending
        return final

    def wait(self) -> CheckpointInfo | None:
        """Block until the in-flight async save is complete; return its info (``None`` if none)."""
        pending, self._pending = self._pending, None
        if pending is None or pending.future is None:
            return None
        comm = self._get_comm()
        step, limit = pending.info.step, self.config.timeout_s
        try:
            pending.future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            message = f"async write of step {step} to {pending.tmp} took over {limit:.0f}s"
            raise CheckpointTimeoutError(message) from None
        except (Exception, CheckpointException) as exc:
            hint = _space_hint(pending.tmp)
            if comm.rank == 0:
                partials.remove(pending.tmp)
            raise CheckpointError(
                f"async write of step {step} to {pending.tmp} failed: {_describe(exc)}{hint}"
            ) from exc
        if comm.rank == 0 and not pending.committed.wait(limit):
            raise CheckpointTimeoutError(f"committing step {step} ({pending.tmp}) took over {limit:.0f}s")
        self._confirm(pending, comm)
        return pending.info

    def close(self) -> None:
        """Finish any in-flight save."""
        self.wait()

    def release_group(self, *, abandon: bool = False) -> None:
        """Let go of the process group the saves used (it is being torn down); the next save makes a new one.

        ``abandon``: a peer died, so an in-flight save can never complete: drop it (its
        temporary directory never gets a marker and is never loaded).
        """
        if abandon:
            self._pending = None
        elif self._pending is not None:
            self.wait()
        self._comm = self._comm_world = (
            None  # holding a gloo group keeps its sockets open: peers blocked on them never fail
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:  # after an error, other ranks may never join the collective wait
            self.close()

    def load(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data: Stateful | None = None,
        step: int | None = None,
    ) -> LoadedState | None:
        """Load the newest usable checkpoint (or exactly ``step``) into the given objects.

        Returns ``None`` when there is none. Partial and corrupt checkpoints are reported
        with a :class:`CheckpointWarning` naming the path and skipped; if no checkpoint is
        usable, raises :class:`CheckpointError` naming every path and why. The objects may
        hold partially loaded values after a failed attempt; a later success overwrites them.
        """
        self.wait()
        comm = self._get_comm()
        targets = _Targets(model, optimizer, scheduler, data)
        if comm.rank == 0:
            for path in recover_interrupted(self.config.dir):
                logger.warning("restored %s, left as .old-* by a save interrupted between its renames", path)
        listing = _scan(self.config.dir) if comm.rank == 0 else None
        complete, partial = comm.broadcast(listing, what="list checkpoints")
        self._check_visible(comm, [name for _, name in complete])
        warned = [(self.config.dir / name, "partial save (never completed); ignored") for name in partial]
        if step is not None:
            complete = [(s, name) for s, name in complete if s == step]
            if not complete:
                raise CheckpointNotFoundError(f"no checkpoint for step {step} in {self.config.dir}")
        failures: list[tuple[Path, str]] = []
        for _, name in complete:
            path = self.config.dir / name
            try:
                info, metadata = verify_checkpoint(path)
                problem = None
            except CheckpointCorruptError as exc:
                problem = exc.reason
            reasons = [r for r in comm.all_gather(problem, what=f"verify {path}") if r]
            if not reasons:
                self._check_compatible(info, metadata, targets)
                try:
                    state = self._read(info, comm, targets)
                except (Exception, CheckpointException) as exc:  # DCP raises on every rank alike
                    reasons = [f"DCP load failed: {_describe(exc)}"]
                else:
                    rng = self._apply(info, comm, targets, state)
                    extra = state[_GLOBAL_KEY]["extra"] or {}
                    eventlog.emit(
                        Record.CHECKPOINT_LOADED,
                        step=info.step,
                        path=str(info.path),
                        saved_world_size=info.world_size,
                    )
                    skipped = tuple(p for p, _ in failures)
                    self._warn_all(comm, warned + failures)
                    return LoadedState(
                        info=info, step=info.step, world_size=comm.world_size, extra=extra, rng=rng, skipped=skipped
                    )
            failures.append((path, reasons[0]))
            if step is not None:
                raise CheckpointCorruptError(path, reasons[0])
        if not failures:
            self._warn_all(comm, warned)
            return None
        damaged = "; ".join(f"{path}: {reason}" for path, reason in failures)
        raise CheckpointError(f"no usable checkpoint in {self.config.dir}, every one is damaged: {damaged}")

    # --------------------------------------------------------------- internals

    def _get_comm(self) -> Comm:
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.group.WORLD if distributed else None
        stale = self._comm_world is not world  # the default group was rebuilt (in-process reconfiguration)
        if self._comm is None or stale or (distributed and not isinstance(self._comm, GroupComm)):
            self._comm_world = world
            if distributed:
                timeout = timedelta(seconds=self.config.timeout_s)
                if self._group is not None:
                    group = self._group
                else:
                    with abort.tracking():  # the round's too: shut down with it when a repair ends the round
                        group = dist.new_group(backend="gloo", timeout=timeout)
                self._comm = GroupComm(group, self.config.timeout_s)
            else:
                self._comm = Comm()
        return self._comm

    @staticmethod
    def _state_to_save(step: int, comm: Comm, targets: _Targets, extra: dict[str, Any] | None) -> dict[str, Any]:
        state = targets.tensor_state()
        rng = capture_rng_state()
        state[f"rng_rank_{comm.rank}"] = _to_bytes(rng_to_plain(rng))
        if comm.rank == 0:
            global_state = {"step": step, "extra": extra, "rng_base_seed": rng.base_seed}
            state[_GLOBAL_KEY] = _to_bytes({**global_state, **targets.global_state()})
        return state

    def _commit(self, pending: _PendingSave, future: concurrent.futures.Future[Any] | None = None) -> None:
        """Rank 0, once DCP is done: check every rank's files, write the marker, rename, prune."""
        try:
            if future is not None and future.exception() is not None:
                return  # the write failed on every rank; wait() reports it
            if problems := _shard_problems(pending.tmp, _read_metadata(pending.tmp)):
                detail = f"rank 0 ({socket.gethostname()}) cannot see files other ranks wrote: {'; '.join(problems)}"
                raise SharedStorageError(pending.tmp, detail)
            recover_interrupted(self.config.dir)
            sequence = 1 + max((info.sequence for info in list_checkpoints(self.config.dir)), default=0)
            info = replace(pending.info, sequence=sequence)
            (pending.tmp / partials.WRITER_NAME).unlink(missing_ok=True)
            _write_marker(pending.tmp, info)
            final = info.path
            replaced = final.with_name(final.name + ".old-" + pending.tmp.name.rsplit("-", 1)[1])
            if final.exists():  # the same step saved again, e.g. right after a resume
                os.replace(final, replaced)
            os.replace(pending.tmp, final)  # a crash before this leaves .old-*: recover_interrupted
            _fsync_dir(final.parent)
            shutil.rmtree(replaced, ignore_errors=True)
            prune(self.config.dir, keep_last=self.config.keep_last, saved=final)
            eventlog.emit(Record.CHECKPOINT_SAVED, step=pending.info.step, path=str(final))
        except CheckpointError as exc:
            pending.commit_error = exc
        except Exception as exc:
            pending.commit_error = CheckpointError(f"committing {pending.tmp} failed: {_describe(exc)}")
        finally:
            if pending.commit_error is not None:
                partials.remove(pending.tmp)  # never committed: its space back
            pending.committed.set()

    def _confirm(self, pending: _PendingSave, comm: Comm) -> None:
        """Every rank checks that it sees the saved files; all ranks raise the same error."""
        final = pending.info.path
        seen = (pending.tmp / _METADATA).is_file() or (final / _METADATA).is_file()  # before or after the rename
        error = pending.commit_error if comm.rank == 0 else None
        reports = comm.all_gather((socket.gethostname(), seen, error), what=f"confirm step {pending.info.step}")
        if reports[0][2] is not None:
            raise reports[0][2]
        if blind := [f"rank {r} ({host})" for r, (host, seen, _) in enumerate(reports) if not seen]:
            detail = f"{', '.join(blind)} cannot see {_METADATA} that rank 0 ({reports[0][0]}) wrote"
            raise SharedStorageError(final, detail)

    def _check_visible(self, comm: Comm, names: list[str]) -> None:
        """Every rank must see the checkpoints rank 0 sees (and see none if rank 0 sees none)."""
        missing = [name for name in names if not (self.config.dir / name).is_dir()]
        report = (socket.gethostname(), missing, len(_scan(self.config.dir)[0]))
        reports = comm.all_gather(report, what=f"list checkpoints in {self.config.dir}")
        rank0 = f"rank 0 ({reports[0][0]})"
        for rank, (host, missing, count) in enumerate(reports):
            if missing:
                detail = f"rank {rank} ({host}) cannot see checkpoint {missing[0]} that {rank0} sees"
                raise SharedStorageError(self.config.dir / missing[0], detail)
            if count and not names:
                detail = f"rank {rank} ({host}) sees {count} checkpoint(s) where {rank0} sees none"
                raise SharedStorageError(self.config.dir, detail)

    @staticmethod
    def _check_compatible(info: CheckpointInfo, metadata: Metadata, targets: _Targets) -> None:
        if absent := [name for name in targets.components() if name not in info.components]:
            raise IncompatibleCheckpointError(
                f"checkpoint {info.path} has no {', '.join(absent)} state (it holds {', '.join(info.components)})"
            )
        saved = metadata.state_dict_metadata
        for fqn, tensor in get_model_state_dict(targets.model).items():
            entry = saved.get(f"model.{fqn}")
            if entry is None:
                raise IncompatibleCheckpointError(f"checkpoint {info.path} has no model entry {fqn!r}")
            if not isinstance(entry, TensorStorageMetadata):
                continue
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            if tuple(entry.size) != shape:
                have = shape if shape is not None else f"a {type(tensor).__name__}, not a tensor"
                raise IncompatibleCheckpointError(
                    f"checkpoint {info.path}: model parameter {fqn!r} has shape {tuple(entry.size)}, the model has {have}"
                )

    @staticmethod
    def _read(info: CheckpointInfo, comm: Comm, targets: _Targets) -> dict[str, Any]:
        """DCP-load into ``targets``' state dicts (in place where they alias live tensors)."""
        state = targets.tensor_state()
        state[_GLOBAL_KEY] = b""
        if info.world_size == comm.world_size:
            state[f"rng_rank_{comm.rank}"] = b""
        with quiet_single_process(comm):
            dcp.load(state, storage_reader=FileSystemReader(info.path), **comm.dcp_kwargs)
        state[_GLOBAL_KEY] = _from_bytes(state[_GLOBAL_KEY])
        return state

    @staticmethod
    def _apply(info: CheckpointInfo, comm: Comm, targets: _Targets, state: dict[str, Any]) -> _RngOutcome:
        """Hand loaded state to its owners; their refusal (e.g. another dataset) is not corruption."""
        saved = state[_GLOBAL_KEY]
        try:
            targets.load_tensor_state(state)
            targets.load_global_state(saved)
        except Exception as exc:
            raise IncompatibleCheckpointError(f"checkpoint {info.path} does not fit: {_describe(exc)}") from exc
        own_rng = state.get(f"rng_rank_{comm.rank}")
        if own_rng is not None:
            restore_rng_state(rng_from_plain(_from_bytes(own_rng)))
            return "restored"
        seed_all(derive_rank_seed(saved["rng_base_seed"], info.step, comm.rank))
        return "reseeded"

    @staticmethod
    def _warn_all(comm: Comm, skipped: list[tuple[Path, str]]) -> None:
        """Rank 0 reports what a load that went on skipped (a failed load's error names it all)."""
        if comm.rank == 0:
            for path, reason in skipped:
                warnings.warn(f"skipping checkpoint {path}: {reason}", CheckpointWarning, stacklevel=4)
