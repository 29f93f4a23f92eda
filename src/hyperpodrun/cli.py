"""``hyperpodrun``: torchrun's command line, elastic.

Every torchrun flag is accepted with the same names (``-`` or ``_`` spelling) and
the same ``PET_*`` environment defaults; a flag given on the command line always
wins over its environment variable. Everything after the training script belongs
to the script. This module only builds a :class:`LaunchConfig` and calls
:func:`hyperpodrun.launch.launch`; domain errors become one line on stderr and an
exit code here, at the boundary, and nowhere else.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.exceptions import TyperException

from elastic_events.contract import SnapshotEvery, parse_snapshot_every
from hyperpodrun import __version__
from hyperpodrun.cli_abbrev import AbbreviatingCommand
from hyperpodrun.config import (
    DEFAULT_SIGNALS,
    LaunchConfig,
    RestartMode,
    parse_int_list,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_signals,
)
from hyperpodrun.errors import ConfigError, HyperpodrunError

app = typer.Typer(
    add_completion=False,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    help="Launch a PyTorch training script on this node, elastic across nodes (drop-in for torchrun).",
)

_RDZV = "Rendezvous"
_WORKERS = "Workers"
_LOGS = "Logs"
_STATIC = "Static membership (torchrun compatible)"
_POLICY = "Elastic policy"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hyperpodrun {__version__}")
        raise typer.Exit()


def _snapshot_every(text: str) -> SnapshotEvery:
    try:
        return parse_snapshot_every(text)
    except ValueError as exc:
        raise ConfigError(f"--snapshot-every: {exc}") from None


def _opt(*names: str, env: str | None = None, help: str, group: str, **kw):
    """An option under both spellings (``--a-b`` and ``--a_b``) with torchrun's ``PET_`` env default."""
    spellings: list[str] = []
    for n in names:
        spellings.append(n)
        if n.startswith("--") and "-" in n[2:]:
            spellings.append("--" + n[2:].replace("-", "_"))
    return typer.Option(*spellings, envvar=env, show_envvar=env is not None, help=help, rich_help_panel=group, **kw)


@app.command(cls=AbbreviatingCommand)
def run(
    ctx: typer.Context,
    training_script: Annotated[
        str,
        typer.Argument(
            help="Script (or module with -m, or executable with --no-python) to run on every rank.", show_default=False
        ),
    ],
    training_script_args: Annotated[
        list[str] | None, typer.Argument(help="Arguments passed to the script unchanged.", show_default=False)
    ] = None,
    nnodes: Annotated[
        str | None,
        _opt(
            "--nnodes",
            env="PET_NNODES",
            group=_RDZV,
            help="Number of nodes, N or MIN:MAX for an elastic job (default 1, or the policy file's bounds).",
            show_default=False,
        ),
    ] = None,
    nproc_per_node: Annotated[
        str,
        _opt("--nproc-per-node", env="PET_NPROC_PER_NODE", group=_WORKERS, help="Ranks per node: N, auto, gpu or cpu."),
    ] = "1",
    rdzv_backend: Annotated[
        str,
        _opt(
            "--rdzv-backend",
            env="PET_RDZV_BACKEND",
            group=_RDZV,
            help="static, c10d/embedded (store hosted by one agent) or etcd (v3 API).",
        ),
    ] = "static",
    rdzv_endpoint: Annotated[
        str,
        _opt(
            "--rdzv-endpoint",
            env="PET_RDZV_ENDPOINT",
            group=_RDZV,
            help="HOST:PORT of the store (etcd accepts a comma-separated list).",
        ),
    ] = "",
    rdzv_id: Annotated[
        str, _opt("--rdzv-id", env="PET_RDZV_ID", group=_RDZV, help="Job id; nodes with the same id form one job.")
    ] = "none",
    rdzv_conf: Annotated[
        str,
        _opt(
            "--rdzv-conf",
            env="PET_RDZV_CONF",
            group=_RDZV,
            help="Extra rendezvous settings, key=value,... (e.g. timeouts, TLS files).",
        ),
    ] = "",
    standalone: Annotated[
        bool,
        _opt(
            "--standalone",
            env="PET_STANDALONE",
            group=_RDZV,
            help="Single-node job with an embedded store on a free local port.",
        ),
    ] = False,
    max_restarts: Annotated[
        int,
        _opt(
            "--max-restarts",
            env="PET_MAX_RESTARTS",
            group=_WORKERS,
            help="Restarts of the worker group after a failure before the job fails.",
        ),
    ] = 0,
    monitor_interval: Annotated[
        float,
        _opt(
            "--monitor-interval",
            env="PET_MONITOR_INTERVAL",
            group=_WORKERS,
            help="Seconds between checks of the workers' state.",
        ),
    ] = 0.1,
    start_method: Annotated[
        str,
        _opt(
            "--start-method",
            env="PET_START_METHOD",
            group=_WORKERS,
            help="spawn or fork: each rank a fresh process (as torchrun runs a script); forkserver: ranks forked "
            "from one server per node that imported torch once (fast starts, restarts and replacements).",
        ),
    ] = "spawn",
    role: Annotated[
        str, _opt("--role", env="PET_ROLE", group=_WORKERS, help="User-defined role of the workers (ROLE_NAME).")
    ] = "default",
    module: Annotated[
        bool,
        _opt("-m", "--module", env="PET_MODULE", group=_WORKERS, help="Run the script as a module, like python -m."),
    ] = False,
    no_python: Annotated[
        bool,
        _opt(
            "--no-python", env="PET_NO_PYTHON", group=_WORKERS, help="Run the script as an executable, not with python."
        ),
    ] = False,
    run_path: Annotated[
        bool,
        _opt(
            "--run-path",
            env="PET_RUN_PATH",
            group=_WORKERS,
            help="Run the script as a path with __name__ == '__main__' (the default behaviour here).",
        ),
    ] = False,
    log_dir: Annotated[
        Path | None,
        _opt(
            "--log-dir",
            env="PET_LOG_DIR",
            group=_LOGS,
            help="Keep worker logs in LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/; no attempt is ever deleted.",
        ),
    ] = None,
    event_log: Annotated[
        Path | None,
        _opt(
            "--event-log",
            env="HYPERPODRUN_EVENT_LOG",
            group=_LOGS,
            help="Append the agent's events (JSON lines) to this file; default LOG_DIR/RUN_ID/events.jsonl.",
        ),
    ] = None,
    redirects: Annotated[
        str,
        _opt(
            "-r",
            "--redirects",
            env="PET_REDIRECTS",
            group=_LOGS,
            help="Send streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or LOCAL_RANK:CODE,...",
        ),
    ] = "0",
    tee: Annotated[
        str,
        _opt(
            "-t",
            "--tee",
            env="PET_TEE",
            group=_LOGS,
            help="Copy streams to log files and the console (same codes as --redirects).",
        ),
    ] = "0",
    local_ranks_filter: Annotated[
        str,
        _opt(
            "--local-ranks-filter",
            env="PET_LOCAL_RANKS_FILTER",
            group=_LOGS,
            help="Show only these local ranks on the console, e.g. 0,2.",
        ),
    ] = "",
    node_rank: Annotated[
        int, _opt("--node-rank", env="PET_NODE_RANK", group=_STATIC, help="Rank of this node (static membership).")
    ] = 0,
    master_addr: Annotated[
        str,
        _opt(
            "--master-addr",
            env="PET_MASTER_ADDR",
            group=_STATIC,
            help="Address of the rank-0 node (static membership).",
        ),
    ] = "127.0.0.1",
    master_port: Annotated[
        int | None,
        _opt(
            "--master-port",
            env="PET_MASTER_PORT",
            group=_STATIC,
            help="Port of rank 0 (static; default 29500 for several nodes, a free port for one).",
        ),
    ] = None,
    local_addr: Annotated[
        str | None,
        _opt(
            "--local-addr",
            env="PET_LOCAL_ADDR",
            group=_RDZV,
            help="Address other nodes use to reach this one (default: its address on the route to the store).",
        ),
    ] = None,
    signals_to_handle: Annotated[
        str,
        _opt(
            "--signals-to-handle",
            env="TORCHELASTIC_SIGNALS_TO_HANDLE",
            group=_WORKERS,
            help="Signals forwarded to the workers.",
        ),
    ] = DEFAULT_SIGNALS,
    hang_timeout: Annotated[
        float | None,
        _opt(
            "--hang-timeout",
            group=_WORKERS,
            help="Seconds a rank may go without calling elastic_event_detected() before it counts as hung: its stacks are dumped to its log and it fails (0: off) [default: 10x the slowest step, at least 60].",
            show_default=False,
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        _opt(
            "--shutdown-timeout",
            env="PET_SHUTDOWN_TIMEOUT",
            group=_WORKERS,
            help="Seconds between SIGTERM and SIGKILL when stopping workers.",
        ),
    ] = 30.0,
    elastic_policy: Annotated[
        Path | None,
        _opt(
            "--elastic-policy",
            group=_POLICY,
            help="YAML/JSON file with HyperPod elasticPolicy fields (minReplicas, maxReplicas, ...); flags override it.",
        ),
    ] = None,
    replica_increment_step: Annotated[
        int | None,
        _opt(
            "--replica-increment-step",
            group=_POLICY,
            help="Allowed node counts are MIN, MIN+STEP, ... (exclusive with --replica-discrete-values).",
        ),
    ] = None,
    replica_discrete_values: Annotated[
        str | None, _opt("--replica-discrete-values", group=_POLICY, help="Allowed node counts, e.g. 2,4,8.")
    ] = None,
    graceful_shutdown_timeout: Annotated[
        float | None,
        _opt(
            "--graceful-shutdown-timeout",
            group=_POLICY,
            help="Seconds ranks get to save and exit at a scale event before they are killed [default: 120].",
        ),
    ] = None,
    scaling_timeout: Annotated[
        float | None,
        _opt(
            "--scaling-timeout",
            group=_POLICY,
            help="Seconds new capacity must stay available before a scale-up; also the longest wait for more nodes at start (--rdzv-conf last_call_timeout, 30 s) [default: 60].",
        ),
    ] = None,
    faulty_scale_down_timeout: Annotated[
        float | None,
        _opt(
            "--faulty-scale-down-timeout",
            group=_POLICY,
            help="Seconds a lost node may come back before the job shrinks without it [default: 30].",
        ),
    ] = None,
    min_stable_period: Annotated[
        float | None,
        _opt(
            "--min-stable-period",
            group=_POLICY,
            help="Seconds a scale-up waits after the last scale event (anti-thrashing); growth after growth keeps this base, reversals lengthen it [default: 60].",
        ),
    ] = None,
    backoff_window: Annotated[
        float | None,
        _opt(
            "--backoff-window",
            group=_POLICY,
            help="Scale events at most this many seconds apart are related: changes of direction among them (up after down, down after up) grow the stable period [default: 900].",
        ),
    ] = None,
    backoff_factor: Annotated[
        float | None,
        _opt(
            "--backoff-factor",
            group=_POLICY,
            help="Factor the stable period grows by per change of direction inside the backoff window [default: 2].",
        ),
    ] = None,
    max_backoff: Annotated[
        float | None,
        _opt("--max-backoff", group=_POLICY, help="Upper bound of the stable period in seconds [default: 600]."),
    ] = None,
    max_world_size: Annotated[
        int | None,
        _opt(
            "--max-world-size",
            group=_POLICY,
            help="Never grow beyond this many ranks (e.g. the samples in one global batch).",
        ),
    ] = None,
    restart_mode: Annotated[
        RestartMode,
        _opt(
            "--restart-mode",
            group=_POLICY,
            help="auto: reconfigure ranks in place at scale events when every rank uses the in-process API; process: always restart them.",
        ),
    ] = RestartMode.AUTO,
    spare_ranks: Annotated[
        int,
        _opt(
            "--spare-ranks",
            group=_POLICY,
            help="Spare processes per node, started (torch imported, no accelerator touched) once the job runs in-process, to replace a failed rank without a process start: 0 or 1.",
        ),
    ] = 1,
    snapshot_every: Annotated[
        str,
        _opt(
            "--snapshot-every",
            group=_POLICY,
            help="A sharded (FSDP2) model under ElasticTraining copies its shards to a peer on another node every N steps, in the background, so a failure rolls back at most N steps and reads no storage. auto: each round times a few snapshots and picks the smallest N whose snapshots cost at most 2% of the step time (0: off; replicated models need none).",
        ),
    ] = "auto",
    metrics_port: Annotated[
        int,
        _opt(
            "--metrics-port",
            env="HYPERPODRUN_METRICS_PORT",
            group=_LOGS,
            help="Serve Prometheus metrics of this agent on this port (0: off).",
        ),
    ] = 0,
    metrics_addr: Annotated[
        str,
        _opt(
            "--metrics-addr",
            env="HYPERPODRUN_METRICS_ADDR",
            group=_LOGS,
            help="Address the metrics endpoint listens on (loopback unless set).",
        ),
    ] = "127.0.0.1",
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    from hyperpodrun.launch import launch
    from hyperpodrun.preflight import check_machine, preflight_warnings

    policy = None
    policy_flags = (
        elastic_policy,
        replica_increment_step,
        replica_discrete_values,
        graceful_shutdown_timeout,
        scaling_timeout,
        faulty_scale_down_timeout,
        min_stable_period,
        backoff_window,
        backoff_factor,
        max_backoff,
    )
    store_backed = rdzv_backend != "static" and not standalone
    if store_backed or any(v is not None for v in policy_flags):
        # Read and validate the policy whatever the backend: a static job then refuses it by name.
        policy = _build_policy(
            elastic_policy,
            nnodes=parse_nnodes(nnodes) if nnodes is not None else None,
            replica_increment_step=replica_increment_step,
            replica_discrete_values=replica_discrete_values,
            graceful_shutdown_timeout=graceful_shutdown_timeout,
            scaling_timeout=scaling_timeout,
            faulty_scale_down_timeout=faulty_scale_down_timeout,
            min_stable_period=min_stable_period,
            backoff_window=backoff_window,
            backoff_factor=backoff_factor,
            max_backoff=max_backoff,
        )
    if store_backed and policy is not None:
        min_nodes, max_nodes = policy.min_replicas, policy.max_replicas
    else:
        min_nodes, max_nodes = parse_nnodes(nnodes or "1:1")
    if standalone:
        if max_nodes > 1:
            raise ConfigError("--standalone runs one node; it cannot be combined with --nnodes > 1")
        if rdzv_endpoint.strip() and _given(ctx, "rdzv_endpoint"):
            raise ConfigError(
                f"--standalone hosts its own store on a free local port; --rdzv-endpoint {rdzv_endpoint} "
                "would be ignored (drop one of them)"
            )
        rdzv_backend, rdzv_endpoint = "embedded", "127.0.0.1:0"
    nproc = parse_nproc_per_node(nproc_per_node)
    config = LaunchConfig(
        entrypoint=training_script,
        args=tuple(training_script_args or ()),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=parse_rdzv_conf(rdzv_conf),
        standalone=standalone,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        role=role,
        module=module,
        no_python=no_python,
        run_path=run_path,
        log_dir=log_dir,
        event_log=event_log,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=parse_int_list(local_ranks_filter, flag="--local-ranks-filter"),
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=local_addr,
        signals_to_handle=parse_signals(signals_to_handle),
        shutdown_timeout=shutdown_timeout,
        policy=policy,
        max_world_size=max_world_size,
        restart_mode=restart_mode,
        spare_ranks=spare_ranks,
        snapshot_every=_snapshot_every(snapshot_every),
        hang_timeout=hang_timeout,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
    )
    check_machine(config)
    for line in (*config.warnings, *preflight_warnings(config)):
        print(f"hyperpodrun: warning: {line}", file=sys.stderr, flush=True)
    launch(config)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether an option was given on the command line (not by its environment variable or default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _build_policy(path: Path | None, *, nnodes: tuple[int, int] | None, replica_discrete_values: str | None, **flags):
    from hyperpodrun.policy_file import build_policy, load_policy_file, parse_replica_values

    flag_values = {
        "min_replicas": nnodes[0] if nnodes else None,
        "max_replicas": nnodes[1] if nnodes else None,
        "replica_discrete_values": parse_replica_values(replica_discrete_values) if replica_discrete_values else None,
        **flags,
    }
    if path is None and nnodes is None:
        flag_values["min_replicas"] = flag_values["max_replicas"] = 1
    file_values = load_policy_file(path) if path is not None else {}
    return build_policy(file_values=file_values, flag_values=flag_values, file_path=path)


def run_app(app: typer.Typer, prog_name: str, argv: list[str] | None) -> int:
    """Run a Typer app as a console script: domain and usage errors become one line and an exit code."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv if argv is not None else sys.argv[1:], prog_name=prog_name, standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except TyperException as e:  # usage errors: unknown option, bad value, missing argument
        print(f"{prog_name}: error: {e.format_message()} (see {prog_name} --help)", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except typer.Abort:
        print(f"{prog_name}: aborted", file=sys.stderr)
        return 130
    except HyperpodrunError as e:
        print(f"{prog_name}: error: {e}", file=sys.stderr)
        return e.exit_code
    return rv if isinstance(rv, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point: returns the process exit status."""
    return run_app(app, "hyperpodrun", argv)


if __name__ == "__main__":
    sys.exit(main())
