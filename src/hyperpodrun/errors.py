"""Typed errors of the launcher.

Domain code raises these; only the CLI boundary turns them into a one-line
message and an exit code (see :mod:`hyperpodrun.cli`).
"""

from __future__ import annotations


class HyperpodrunError(Exception):
    """Base class of every error the launcher reports to the user."""

    exit_code: int = 1


class ConfigError(HyperpodrunError, ValueError):
    """A flag, policy file or environment value is invalid (detected before anything starts)."""

    exit_code = 2


class LaunchError(HyperpodrunError):
    """The workers could not be started (missing script, unusable log dir, ...)."""


class WorkerFailedError(HyperpodrunError):
    """A worker rank failed and no restarts were left; carries the root-cause summary."""

    def __init__(self, summary: str, exit_code: int = 1) -> None:
        super().__init__(summary)
        self.exit_code = exit_code


class RendezvousError(HyperpodrunError):
    """Base class of rendezvous failures."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete within its timeout."""


class RendezvousClosedError(RendezvousError):
    """The job is over for this node: it ``succeeded``, ``failed``, or this node ``left`` gracefully."""

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status


class SignalReceived(HyperpodrunError):
    """The launcher received a termination signal and stopped its workers."""

    def __init__(self, signum: int) -> None:
        import signal as _signal

        super().__init__(f"received {_signal.Signals(signum).name}; workers stopped")
        self.signum = signum
        self.exit_code = 128 + signum
