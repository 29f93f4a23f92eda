"""Checks of a :class:`LaunchConfig` against this machine, before anything starts.

:func:`check_machine` raises :class:`ConfigError` for input that cannot work here (an address
that is not this machine's, a log folder that cannot be made, an event log that is a folder);
:func:`preflight_warnings` names input that works but is probably not meant (more ranks than
usable CPUs). The CLI prints the warnings and turns the errors into one line and exit 2.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from hyperpodrun.config import LaunchConfig, RendezvousMode
from hyperpodrun.devices import usable_cpus
from hyperpodrun.errors import ConfigError

__all__ = ["check_machine", "preflight_warnings"]


def check_machine(config: LaunchConfig) -> None:
    """Raise ConfigError for a flag this machine cannot honour."""
    if config.local_addr is not None and config.mode is RendezvousMode.ELASTIC:
        _check_local_addr(config.local_addr)
    if config.log_dir is not None:
        _check_folder(config.log_dir, flag="--log-dir")
    if config.event_log is not None:
        path = Path(config.event_log)
        if path.is_dir():
            raise ConfigError(f"--event-log {path}: is a folder; give the path of a file (JSON lines are appended)")
        _check_folder(path.parent, flag="--event-log")


def preflight_warnings(config: LaunchConfig) -> list[str]:
    """Legal but probably unintended settings, one line each."""
    out = []
    cpus = usable_cpus()
    if config.nproc_per_node > cpus:
        out.append(
            f"--nproc-per-node {config.nproc_per_node}: more ranks than the {cpus} CPU(s) this process may use; "
            "they will compete for cores"
        )
    return out


def _check_local_addr(addr: str) -> None:
    """The address must be one of this machine's: other nodes reach the ranks there."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--local-addr {addr}: cannot resolve it: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"--local-addr {addr}: not an address of this machine (other nodes reach this node's ranks there)"
                ) from None
            raise ConfigError(f"--local-addr {addr}: cannot listen there: {e.strerror}") from None


def _check_folder(folder: Path, *, flag: str) -> None:
    """``folder`` exists (made if missing) and this user may write to it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {folder}: cannot create the folder: {e.strerror or e}") from None
    if not folder.is_dir():
        raise ConfigError(f"{flag} {folder}: exists and is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {folder}: this user may not write there")
