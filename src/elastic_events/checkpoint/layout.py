"""On-disk layout of checkpoints: markers, listing, verification, and the errors they raise.

See :mod:`elastic_events.checkpoint` for the save protocol that produces this layout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from elastic_events.checkpoint.partials import writer_gone

MARKER_NAME = "COMPLETE"
_FORMAT_VERSION = 1
_METADATA = ".metadata"
_COMPLETE_RE = re.compile(r"^step_(\d+)$")
_PARTIAL_RE = re.compile(r"^step_\d+\.(?:tmp|old)-[0-9a-f]+$")
_OLD_RE = re.compile(r"^(step_\d+)\.old-[0-9a-f]+$")


# ------------------------------------------------------------------------- errors


class CheckpointError(RuntimeError):
    """Base class of every checkpoint failure."""


class CheckpointNotFoundError(CheckpointError):
    """A specifically requested checkpoint does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint directory is partial or damaged and must not be loaded."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"checkpoint {path} is unusable: {reason}")
        self.path, self.reason = Path(path), reason

    def __reduce__(self) -> tuple[Any, ...]:  # errors travel between ranks pickled
        return type(self), (self.path, self.reason)


class IncompatibleCheckpointError(CheckpointError):
    """A sound checkpoint that does not fit what the caller asked to load into."""


class SharedStorageError(CheckpointError):
    """Ranks do not see the same checkpoint files: the directory is not shared."""

    def __init__(self, path: Path | str, detail: str) -> None:
        super().__init__(
            f"{detail}; checkpoints need a filesystem shared by all nodes and mounted at the "
            f"same path (e.g. NFS, Lustre, FSx): {path}"
        )
        self.path, self.detail = Path(path), detail

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.detail)


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """An async write or its commit did not finish in time."""


class CheckpointWarning(UserWarning):
    """A partial or corrupt checkpoint was skipped."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What a ``COMPLETE`` marker records about one checkpoint."""

    step: int
    path: Path
    world_size: int
    saved_at: float
    torch_version: str
    components: tuple[str, ...]
    sequence: int = 0
    """Save order within the directory (1 + the highest before it); 0 for markers that predate it."""

    def to_json(self) -> str:
        fields = {k: v for k, v in vars(self).items() if k != "path"}
        return json.dumps({"format": _FORMAT_VERSION, **fields, "components": list(self.components)})

    @classmethod
    def from_marker(cls, path: Path) -> CheckpointInfo:
        """Parse ``path/COMPLETE``; raise :class:`CheckpointCorruptError` if absent or malformed."""
        try:
            raw = json.loads((path / MARKER_NAME).read_text())
            info = cls(
                step=int(raw["step"]),
                path=path,
                world_size=int(raw["world_size"]),
                saved_at=float(raw["saved_at"]),
                torch_version=str(raw["torch_version"]),
                components=tuple(raw["components"]),
                sequence=int(raw.get("sequence", 0)),
            )
        except FileNotFoundError:
            raise CheckpointCorruptError(path, f"no {MARKER_NAME} marker (save did not finish)") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(path, f"unreadable {MARKER_NAME} marker: {exc}") from exc
        match = _COMPLETE_RE.match(path.name)
        if match is None or int(match.group(1)) != info.step:
            raise CheckpointCorruptError(path, f"marker says step {info.step}, the directory name disagrees")
        return info


# ------------------------------------------------------------------ on-disk checks


def _scan(root: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """Final-named checkpoint dirs newest first, and partial (``.tmp-``/``.old-``) dirs."""
    try:
        names = [entry.name for entry in os.scandir(root) if entry.is_dir()]
    except FileNotFoundError:
        return [], []
    complete = sorted(((int(m.group(1)), n) for n in names if (m := _COMPLETE_RE.match(n))), reverse=True)
    return complete, sorted(n for n in names if _PARTIAL_RE.match(n))


def prepare_directory(root: Path) -> None:
    """Create ``root`` if needed and check that this process can write there, so that an
    unusable checkpoint directory fails at start, not at the first save hours later."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointError(f"checkpoint directory {root} exists and is not a directory") from None
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {root}: {exc.strerror or exc}") from None
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} exists and is not a directory")
    probe = root / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {root} is not writable: {exc.strerror or exc}") from None


def save_order(info: CheckpointInfo) -> tuple[int, float, int]:
    """Sort key by save order: the marker's sequence, then its time (markers without one)."""
    return info.sequence, info.saved_at, info.step


def recover_interrupted(root: Path | str) -> list[Path]:
    """Put back ``step_N.old-*`` copies left by a crash between a re-save's two renames.

    Re-saving step N renames the committed ``step_N`` to ``step_N.old-<token>`` and then the
    new copy into place; a crash in between leaves only the ``.old`` copy. Each one whose
    ``step_N`` is absent is renamed back (it is complete: it was committed). Returns the
    paths restored. Safe to call from several processes: a lost race is ignored.
    """
    root = Path(root)
    restored = []
    for name in _scan(root)[1]:
        match = _OLD_RE.match(name)
        if match is None or (root / match.group(1)).exists():
            continue
        with contextlib.suppress(FileNotFoundError, FileExistsError, OSError):
            os.rename(root / name, root / match.group(1))
            restored.append(root / match.group(1))
    return restored


def list_checkpoints(root: Path | str) -> list[CheckpointInfo]:
    """Checkpoints under ``root`` with a readable marker and a ``.metadata``, newest first.

    Cheap: shard files are checked by :func:`verify_checkpoint` and at load.
    """
    found = []
    for _, name in _scan(Path(root))[0]:
        with contextlib.suppress(CheckpointCorruptError):
            info = CheckpointInfo.from_marker(Path(root) / name)
            if (info.path / _METADATA).is_file():
                found.append(info)
    return found


def remove_abandoned(root: Path) -> list[Path]:
    """Remove partial saves nobody writes any more: ``.tmp-*`` folders of dead writers
    (:mod:`.partials`), ``.old-*`` copies superseded by their ``step_N``."""
    removed = []
    for name in _scan(root)[1]:
        match = _OLD_RE.match(name)
        superseded = match is not None and (root / match.group(1)).exists()
        if superseded or (match is None and writer_gone(root / name)):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(root / name)
    return removed


def prune(root: Path, *, keep_last: int | None, saved: Path) -> list[Path]:
    """Drop abandoned partial saves, and checkpoints beyond the ``keep_last`` most recently *saved*.

    Save order, not step number: after resuming from an older step (``load(step=K)``, or
    past a damaged newer checkpoint) the fresh saves are the ones to keep. Never removed:
    ``saved`` (just committed), anything saved after it (another writer), and nothing at
    all unless a checkpoint that stays verifies (never the only loadable one).
    Run :func:`recover_interrupted` first so that no ``.old-*`` copy here is still needed.
    Returns the checkpoints removed.
    """
    remove_abandoned(root)  # never another writer's save in progress
    infos = sorted(list_checkpoints(root), key=save_order, reverse=True)
    just_saved = next((info for info in infos if info.path == saved), None)
    if keep_last is None or just_saved is None:
        return []
    keep = [info for info in infos if info.path == saved or save_order(info) > save_order(just_saved)]
    for info in infos:
        if len(keep) >= keep_last:
            break
        if info not in keep:
            keep.append(info)
    if not any(_verifies(info.path) for info in keep):
        return []
    removed = [info.path for info in infos if info not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path)
    except CheckpointCorruptError:
        return False
    return True


def _shard_problems(path: Path, metadata: Metadata) -> list[str]:
    """Shard files named by ``.metadata`` that are absent or shorter than recorded."""
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    problems = []
    for name, size in sorted(needed.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"shard file {name} is missing")
            continue
        if actual < size:
            problems.append(f"shard file {name} is truncated ({actual} of {size} bytes)")
    return problems


def _read_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointCorruptError(path, f"no {_METADATA} file") from None
    except Exception as exc:  # a truncated pickle raises anything from EOFError to ValueError
        raise CheckpointCorruptError(path, f"unreadable {_METADATA}: {type(exc).__name__}: {exc}") from exc


def verify_checkpoint(path: Path | str) -> tuple[CheckpointInfo, Metadata]:
    """Check marker, ``.metadata`` and every shard file; raise :class:`CheckpointCorruptError`."""
    info = CheckpointInfo.from_marker(Path(path))
    metadata = _read_metadata(info.path)
    if problems := _shard_problems(info.path, metadata):
        raise CheckpointCorruptError(info.path, "; ".join(problems))
    return info, metadata


def _write_marker(directory: Path, info: CheckpointInfo) -> None:
    tmp = directory / f"{MARKER_NAME}.partial"
    with open(tmp, "w") as handle:
        handle.write(info.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / MARKER_NAME)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(blob: bytes) -> Any:
    # weights_only: tensors, numbers, strings and containers of them, nothing executable.
    return torch.load(io.BytesIO(blob), weights_only=True)


def _describe(exc: BaseException) -> str:
    """One line per failing rank instead of DCP's concatenated tracebacks."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"
