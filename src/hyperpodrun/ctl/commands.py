"""The ``hyperpodctl`` commands: thin typer wrappers over :mod:`.status`, :mod:`.job` and :mod:`.steer`.

The five connection options are declared once, in :data:`_CONNECTION`; :func:`_connected`
appends them to a command's signature and hands the command a built
:class:`ConnectionSettings`, so they are spelt after the subcommand
(``hyperpodctl status --rdzv-id JOB``) like every other option.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any

import typer

from hyperpodrun import __version__
from hyperpodrun.ctl.job import ConnectionSettings, read_job
from hyperpodrun.ctl.status import (
    JobRecords,
    NoSuchJobError,
    format_history_entry,
    job_exists,
    job_status,
    render_status,
)
from hyperpodrun.ctl.steer import FollowEnd, follow_history, set_cap, yield_replicas
from hyperpodrun.errors import ConfigError
from hyperpodrun.rendezvous.records import HistoryEntry

__all__ = ["app"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Inspect and steer hyperpodrun jobs through their rendezvous store.",
)

_PANEL = "Connection (the values the job was launched with)"


def _opt(name: str, *, env: str | None = None, help: str, **kw: Any) -> Any:
    """A connection option, also spelt with underscores (``--rdzv_id``) as torchrun accepts."""
    spellings = [name, "--" + name[2:].replace("-", "_")]
    return typer.Option(*spellings, envvar=env, show_envvar=env is not None, help=help, rich_help_panel=_PANEL, **kw)


def _param(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


_CONNECTION = (
    _param(
        "rdzv_id", Annotated[str, _opt("--rdzv-id", env="PET_RDZV_ID", help="The job's --rdzv-id.", show_default=False)]
    ),
    _param(
        "rdzv_backend",
        Annotated[
            str,
            _opt("--rdzv-backend", env="PET_RDZV_BACKEND", help="etcd, or c10d/embedded (an agent hosts the store)."),
        ],
        "etcd",
    ),
    _param(
        "rdzv_endpoint",
        Annotated[
            str,
            _opt(
                "--rdzv-endpoint",
                env="PET_RDZV_ENDPOINT",
                help="HOST:PORT of the store (etcd: a comma-separated list); default 127.0.0.1 at the backend's port.",
                show_default=False,
            ),
        ],
        "",
    ),
    _param(
        "rdzv_conf",
        Annotated[
            str,
            _opt(
                "--rdzv-conf",
                env="PET_RDZV_CONF",
                help="The job's key=value,...: the store's keys (etcd TLS/auth: cacert, cert, key, protocol, user, password) apply; the rendezvous' settings are ignored.",
            ),
        ],
        "",
    ),
    _param(
        "store_timeout",
        Annotated[float, _opt("--store-timeout", help="Seconds to keep trying to reach the store.")],
        10.0,
    ),
)


def _connected(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command(connection: ConnectionSettings, ...)`` the connection options instead of that parameter."""
    own = inspect.signature(command, eval_str=True)
    params = [p for name, p in own.parameters.items() if name != "connection"]

    @functools.wraps(command)
    def wrapper(
        *, rdzv_id: str, rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: str, store_timeout: float, **kwargs: Any
    ) -> None:
        connection = ConnectionSettings.from_flags(
            backend=rdzv_backend, endpoint=rdzv_endpoint, run_id=rdzv_id, rdzv_conf=rdzv_conf, timeout=store_timeout
        )
        command(connection=connection, **kwargs)

    wrapper.__signature__ = own.replace(parameters=[*params, *_CONNECTION])  # type: ignore[attr-defined]
    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hyperpodctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Inspect and steer hyperpodrun jobs through their rendezvous store."""


@app.command()
@_connected
def status(
    connection: ConnectionSettings,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every field, full history).")] = False,
    history: Annotated[int, typer.Option("--history", min=0, help="Recent decisions to show.")] = 10,
) -> None:
    """Members, world size, round, standbys, pending scale event, cap and recent decisions."""
    with connection.connect() as store:
        result = job_status(read_job(store), run_id=connection.run_id, endpoint=connection.endpoint)
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_status(result, history=history))


@app.command()
@_connected
def cap(
    connection: ConnectionSettings,
    replicas: Annotated[
        int, typer.Argument(min=0, help="Most replicas (nodes) the job may run at.", show_default=False)
    ],
) -> None:
    """Cap the job at REPLICAS; a larger job shrinks to the largest allowed size <= REPLICAS."""
    with connection.connect() as store:
        records = set_cap(store, connection, replicas)
    typer.echo(_cap_message(connection.run_id, replicas, records))


@app.command()
@_connected
def uncap(connection: ConnectionSettings) -> None:
    """Lift the cap: the job may grow to its maximum again."""
    with connection.connect() as store:
        records = set_cap(store, connection, None)
    was = f" (was {records.cap})" if records.cap is not None else " (there was none)"
    typer.echo(f"job {connection.run_id}: cap lifted{was}; the job may grow to its maximum replica count")


@app.command("yield")
@_connected
def yield_(
    connection: ConnectionSettings,
    count: Annotated[int, typer.Argument(min=1, help="Replicas (nodes) to give back now.", show_default=False)],
) -> None:
    """Give back COUNT replicas now: sets the cap COUNT below the current size (or the current cap)."""
    with connection.connect() as store:
        new_cap, records = yield_replicas(store, connection, count)
    typer.echo(_cap_message(connection.run_id, new_cap, records))


@app.command()
@_connected
def events(
    connection: ConnectionSettings,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new decisions until the job ends or --timeout.")
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to follow before giving up (with --follow).")
    ] = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """The job's decisions (rounds and scale events) with their reasons, oldest first."""
    if follow and not timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {timeout:g}")

    def emit(entry: HistoryEntry) -> None:
        typer.echo(json.dumps(asdict(entry)) if as_json else format_history_entry(entry))

    with connection.connect() as store:
        records = read_job(store)
        if not job_exists(records):
            raise NoSuchJobError(connection.run_id, connection.endpoint)
        if not follow:
            for entry in records.history:
                emit(entry)
            return
        end, closed = follow_history(store, timeout=timeout, emit=emit)
    if end is FollowEnd.TIMEOUT or closed is None:
        print(f"hyperpodctl: stopped following after --timeout {timeout:g}s; the job is still open", file=sys.stderr)
    else:
        print(f"hyperpodctl: job {connection.run_id} ended: {closed.status.value}: {closed.message}", file=sys.stderr)


def _cap_message(run_id: str, cap: int, records: JobRecords) -> str:
    text = f"job {run_id}: cap set to {cap} replica(s)"
    if records.round is None:
        return text + "; the job has not started yet and will start with at most that many"
    size = len(records.round.members)
    if cap == 0:
        return text + f" (running {size}); its ranks save and stop, and it waits until the cap is raised"
    if cap < size:
        return (
            text + f"; shrinking from {size} to the largest allowed replica count <= {cap} "
            "(if none is allowed, e.g. below minReplicas, the job saves, stops and waits)"
        )
    return text + f"; running {size}, so nothing changes now: the job will not grow beyond {cap}"
