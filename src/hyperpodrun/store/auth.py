"""The embedded store's shared secret: where it comes from, and the per-user local copy.

* Multi-node jobs (a store endpoint that is not loopback) must name a secret, shared by
  every node: ``--rdzv-conf secret_file=PATH`` or the ``HYPERPODRUN_STORE_SECRET``
  variable. Without one, the agent refuses to host or join the store.
* One-host jobs (loopback endpoint, ``--standalone``) need nothing: the hosting agent
  generates a secret and writes it to a file only its user can read
  (``$XDG_RUNTIME_DIR`` or ``/dev/shm``, folder ``hyperpodrun-<uid>``, mode 0700); the
  other agents and ``hyperpodctl`` of that user read it there. Other users of the host,
  who can reach any loopback port, cannot.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hyperpodrun.security import STORE_SECRET_ENV
from hyperpodrun.store.base import StoreConfigError

__all__ = [
    "is_loopback",
    "loopback_name",
    "local_secret_path",
    "new_secret",
    "publish_local_secret",
    "read_local_secret",
    "unpublish_local_secret",
    "resolve_store_secret",
]

_MIN_SECRET_BYTES = 16
#: The first line of a published secret file: ``publisher-pid=PID start=TICKS`` (see :func:`publish_local_secret`).
_OWNER_TAG = b"publisher-pid="


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_name(host: str) -> str | None:
    """The loopback address a host *name* resolves to here (Debian maps the hostname to 127.0.1.1);
    None for an address, ``localhost``, a name of other addresses, or one that does not resolve."""
    if is_loopback(host):
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    addresses: set[str] = set()
    for info in infos:
        address = info[4][0]  # (family, bytes) for a family this Python was built without
        if not isinstance(address, str) or not is_loopback(address):
            return None
        addresses.add(address)
    return min(addresses) if addresses else None


def resolve_store_secret(conf: Mapping[str, str], env: Mapping[str, str]) -> bytes | None:
    """The shared secret named by ``secret_file`` (wins) or :data:`STORE_SECRET_ENV`, if any."""
    path = conf.get("secret_file")
    if path is not None:
        if not path:
            raise StoreConfigError("--rdzv-conf secret_file needs a path")
        try:
            mode = os.stat(path).st_mode
            data = Path(path).read_bytes().strip()
        except OSError as e:
            raise StoreConfigError(f"--rdzv-conf secret_file: cannot read {path!r}: {e.strerror or e}") from None
        if mode & stat.S_IRWXO:
            raise StoreConfigError(
                f"--rdzv-conf secret_file: {path!r} is accessible to other users; chmod o-rwx {path}"
            )
        where = f"--rdzv-conf secret_file {path!r}"
    elif env.get(STORE_SECRET_ENV):
        data, where = env[STORE_SECRET_ENV].strip().encode(), STORE_SECRET_ENV
    else:
        return None
    if len(data) < _MIN_SECRET_BYTES:
        raise StoreConfigError(
            f"{where}: the store secret must be at least {_MIN_SECRET_BYTES} characters (e.g. openssl rand -hex 32)"
        )
    return data


def _private_dir() -> Path:
    """``hyperpodrun-<uid>`` under a per-user or memory-backed folder, 0700 and ours."""
    base = os.environ.get("XDG_RUNTIME_DIR") or (
        "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )
    directory = Path(base) / f"hyperpodrun-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise StoreConfigError(
            f"{directory} must be a folder owned by uid {os.getuid()} with mode 0700 (it holds store secrets)"
        )
    return directory


def local_secret_path(host: str, port: int) -> Path:
    safe_host = host.replace(":", "_").replace("/", "_")
    return _private_dir() / f"store-{safe_host}-{port}.secret"


def publish_local_secret(host: str, port: int, secret: bytes) -> Path:
    """Write ``secret`` for this user's other agents on this host (atomically, mode 0600), stamped with this
    process's identity so that a file left by an agent killed before it could remove it is known as stale."""
    path = local_secret_path(host, port)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(_owner_line(os.getpid()) + secret)
    os.replace(tmp, path)
    return path


def unpublish_local_secret(path: Path, secret: bytes) -> None:
    """Remove the file :func:`publish_local_secret` wrote, unless another agent's secret has replaced it."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == _owner_line(os.getpid()) + secret:
            path.unlink()


def read_local_secret(host: str, port: int) -> bytes | None:
    """The secret a running local host agent published for ``host:port``; None when there is none, or when
    the process that published it has gone (the port may now be another server's)."""
    try:
        data = local_secret_path(host, port).read_bytes()
    except (FileNotFoundError, StoreConfigError):
        return None
    owner, sep, secret = data.partition(b"\n")
    if not sep or not owner.startswith(_OWNER_TAG):
        return None
    pid = owner.removeprefix(_OWNER_TAG).split(b" ", 1)[0]
    if not pid.isdigit() or _owner_line(int(pid)) != owner + b"\n":
        return None
    return secret or None


def _owner_line(pid: int) -> bytes:
    """``publisher-pid=PID start=TICKS``: the start time tells a reused pid from the publisher."""
    return b"%s%d start=%s\n" % (_OWNER_TAG, pid, _start_ticks(pid).encode())


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (``/proc/PID/stat`` field 22); ``gone`` when no such process runs (or only
    its zombie), ``unknown`` where ``/proc`` is not there (liveness is then all that is checked)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return "gone" if Path("/proc/self/stat").exists() else _alive_or_gone(pid)
    except OSError:
        return _alive_or_gone(pid)
    return "gone" if fields[0] in (b"Z", b"X") else fields[19].decode()


def _alive_or_gone(pid: int) -> str:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    return "unknown"
