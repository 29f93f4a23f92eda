"""Launch configuration: one keyword-only dataclass built by the CLI, validated on construction.

Parsing helpers turn torchrun's string flags (``--nnodes 1:4``, ``--rdzv-conf k=v,...``,
``--redirects 0:3,1:1``) into typed values; every error names the flag it is about.
Everything is resolved here, once: the rendezvous mode (static or elastic), the backend
(:data:`hyperpodrun.store.BACKEND_SPECS`), and ``--rdzv-conf`` split into the rendezvous'
:class:`RendezvousSettings` and the store's keys, unknown keys rejected.
"""

from __future__ import annotations

import difflib
import math
import os
import shutil
import signal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum, IntFlag
from pathlib import Path

from elastic_events.contract import AUTO, SnapshotEvery, is_snapshot_every
from hyperpodrun.errors import ConfigError
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.security import run_id_problem
from hyperpodrun.store.factory import BACKEND_SPECS, BackendSpec

RDZV_BACKENDS = (*BACKEND_SPECS, "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class Std(IntFlag):
    """Which standard streams a redirect/tee applies to (torchrun's 0..3 encoding)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX)."""
    parts = value.strip().split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes: expected N or MIN:MAX, got {value!r}") from None
    if lo < 1:
        raise ConfigError(f"--nnodes: the minimum must be >= 1, got {value!r}")
    if hi < lo:
        raise ConfigError(f"--nnodes: MIN must not exceed MAX, got {value!r}")
    return lo, hi


def parse_nproc_per_node(value: str) -> int:
    """``N``, or a word torchrun accepts (``auto``, ``cpu``, ``gpu``, ``xpu``): see :mod:`hyperpodrun.devices`."""
    value = value.strip()
    try:
        n = int(value)
    except ValueError:
        from hyperpodrun.devices import ranks_for

        return ranks_for(value)
    if n < 1:
        raise ConfigError(f"--nproc-per-node: must be >= 1, got {n}")
    return n


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> dict; empty string -> {}.

    Quotes around the whole value are dropped: ``--rdzv-conf='a=1,b=2'`` reaches the launcher
    with them when a shell, a YAML file or a job template passes the text unchanged.
    """
    conf: dict[str, str] = {}
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1].strip()
    if not value:
        return conf
    for item in value.split(","):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf: expected key=value[,key=value...], got item {item!r}")
        conf[key] = val.strip()
    return conf


def parse_std(value: str, *, flag: str, nproc: int) -> dict[int, Std]:
    """torchrun's redirect/tee spec: ``"3"`` for every rank or ``"0:3,1:1"`` per local rank."""
    value = value.strip() or "0"

    def one(text: str) -> Std:
        try:
            code = int(text)
            if code not in (0, 1, 2, 3):
                raise ValueError
        except ValueError:
            raise ConfigError(f"{flag}: expected 0, 1, 2 or 3 (none, stdout, stderr, both), got {text!r}") from None
        return Std(code)

    if ":" not in value:
        std = one(value)
        return {r: std for r in range(nproc)}
    out = {r: Std.NONE for r in range(nproc)}
    for item in value.split(","):
        rank_s, _, code = item.partition(":")
        try:
            rank = int(rank_s)
        except ValueError:
            raise ConfigError(f"{flag}: expected LOCAL_RANK:CODE items, got {item!r}") from None
        if not 0 <= rank < nproc:
            raise ConfigError(f"{flag}: local rank {rank} out of range for --nproc-per-node {nproc}")
        out[rank] = one(code)
    return out


def parse_int_list(value: str, *, flag: str) -> frozenset[int]:
    """``"0,2"`` -> {0, 2}; empty -> all (empty set)."""
    if not value.strip():
        return frozenset()
    try:
        return frozenset(int(v) for v in value.split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {value!r}") from None


def parse_signals(value: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGINT"`` -> the signals, each validated by name."""
    out = []
    for name in (v.strip() for v in value.split(",") if v.strip()):
        try:
            out.append(signal.Signals[name])
        except KeyError:
            raise ConfigError(f"--signals-to-handle: unknown signal {name!r}") from None
    return tuple(out)


class RestartMode(str, Enum):
    """``--restart-mode``: AUTO reconfigures ranks in place at a scale event when every rank declared
    the in-process API; PROCESS always restarts them (save, exit, start at the new size)."""

    AUTO = "auto"
    PROCESS = "process"


class RendezvousMode(str, Enum):
    """STATIC: torchrun's fixed membership (``--rdzv-backend static`` or ``--standalone``).
    ELASTIC: membership, rounds and scale events through a store (etcd, or embedded in one agent)."""

    STATIC = "static"
    ELASTIC = "elastic"


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    """The rendezvous' ``--rdzv-conf`` keys (all seconds), validated on construction."""

    lease_ttl: float = 10.0  # a node that stops heartbeating for this long has left the job
    join_timeout: float = 600.0  # how long a node waits to be admitted to a round (torchrun's c10d default)
    last_call_timeout: float = 30.0  # at start, the wait for more nodes once the minimum is there (torchrun's)
    ack_timeout: float = 30.0  # how long the decider waits for members to acknowledge an event
    propagation: float = 1.0  # budget for a target step to reach every rank
    tick: float = 0.2  # how often agents re-read the store at most
    store_timeout: float = 10.0  # how long a store operation may keep failing before the store is lost
    outage_timeout: float = 60.0  # how long running ranks ride out an unreachable store before the job ends

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not value > 0
            ):
                raise ConfigError(f"--rdzv-conf {f.name}: must be a finite number of seconds > 0, got {value!r}")


#: torchrun's ``--rdzv-conf`` keys that carry a meaning here under another name.
TORCHRUN_CONF_ALIASES: Mapping[str, str] = {"read_timeout": "store_timeout"}
#: torchrun's ``timeout``: the etcd rendezvous' overall timeout (our ``join_timeout``); its c10d
#: rendezvous ignores it (the launcher always sets it), and so does ours.
ETCD_TIMEOUT_ALIAS = ("timeout", "join_timeout")
TORCHRUN_CONF_IGNORED: tuple[str, ...] = (
    "timeout",
    "close_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "is_host",
    "use_agent_store",
)


def _aliases(spec: BackendSpec) -> Mapping[str, str]:
    return {**TORCHRUN_CONF_ALIASES, **(dict([ETCD_TIMEOUT_ALIAS]) if spec.kind == "etcd" else {})}


def _known_conf_keys(spec: BackendSpec) -> list[str]:
    return sorted({f.name for f in fields(RendezvousSettings)} | set(_aliases(spec)) | set(spec.conf_keys))


def split_rdzv_conf(conf: Mapping[str, str], spec: BackendSpec) -> tuple[RendezvousSettings, dict[str, str]]:
    """``--rdzv-conf`` as (rendezvous settings, the store's keys).

    Keys nobody uses are ignored, as torchrun ignores them (:func:`unused_rdzv_conf` names them for
    a warning), except a near miss of a known key: a typo is an error that names the known keys.
    """
    setting_names = {f.name for f in fields(RendezvousSettings)}
    aliases = _aliases(spec)
    settings: dict[str, float] = {}
    store: dict[str, str] = {}
    for key, raw in conf.items():
        name = aliases.get(key, key)
        if name in setting_names:
            if key in aliases and name in conf:
                continue  # our own spelling wins over torchrun's
            try:
                settings[name] = float(raw)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}: expected seconds, got {raw!r}") from None
        elif key in spec.conf_keys:
            store[key] = raw
        elif key not in TORCHRUN_CONF_IGNORED:
            known = _known_conf_keys(spec)
            if difflib.get_close_matches(key, known, n=1, cutoff=0.8):
                raise ConfigError(
                    f"--rdzv-conf: unknown key {key!r} for --rdzv-backend {spec.name}; known keys: {', '.join(known)}"
                )
    return RendezvousSettings(**settings), store


def unused_rdzv_conf(conf: Mapping[str, str], spec: BackendSpec) -> list[str]:
    """The ``--rdzv-conf`` keys that nothing here uses (torchrun's keys without a meaning here excepted)."""
    known = set(_known_conf_keys(spec)) | set(TORCHRUN_CONF_IGNORED)
    return [key for key in conf if key not in known]


@dataclass(kw_only=True)
class LaunchConfig:
    """Everything the agent needs, validated; built by the CLI from torchrun-compatible flags."""

    entrypoint: str
    args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: Path | None = None
    event_log: Path | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] = frozenset()
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    signals_to_handle: tuple[signal.Signals, ...] = field(default_factory=lambda: parse_signals(DEFAULT_SIGNALS))
    shutdown_timeout: float = 30.0
    policy: ElasticPolicy | None = None  # elastic jobs (store-backed rendezvous) only
    max_world_size: int | None = None
    restart_mode: RestartMode = RestartMode.AUTO
    hang_timeout: float | None = None  # seconds without progress; None: 10x the slowest step, at least 60; 0: off
    spare_ranks: int = 1  # pre-started replacements per node for a job repaired in place (0 or 1)
    # a sharded model's in-memory snapshots, every N steps (0: off) or chosen by their cost ("auto");
    # elastic_events.rounds.snapshot_interval
    snapshot_every: SnapshotEvery = AUTO
    metrics_port: int = 0  # Prometheus endpoint of this agent; 0: off
    metrics_addr: str = "127.0.0.1"
    log_line_prefix_template: str | None = (
        None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: ${role_name} ${rank} ${local_rank}
    )
    python: str = field(default_factory=lambda: os.environ.get("PYTHON_EXEC", "") or _default_python())

    def __post_init__(self) -> None:
        if self.rdzv_id != "none" and (problem := run_id_problem(self.rdzv_id)):
            raise ConfigError(problem)  # before it names a log folder or store keys
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise ConfigError(f"nnodes: invalid range {self.min_nodes}:{self.max_nodes}")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node: must be >= 1, got {self.nproc_per_node}")
        if self.rdzv_backend == "etcd-v2":
            raise ConfigError(
                "--rdzv-backend etcd-v2: the etcd v2 API is not supported; use --rdzv-backend etcd (v3 API)"
            )
        if self.rdzv_backend in ("etcd", "etcd-v3") and not self.rdzv_endpoint.strip():
            raise ConfigError("--rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...]")
        if self.rdzv_backend not in BACKEND_SPECS:
            raise ConfigError(
                f"--rdzv-backend: unknown backend {self.rdzv_backend!r}; choose one of {', '.join(RDZV_BACKENDS)}"
            )
        self.backend = BACKEND_SPECS[self.rdzv_backend]
        self.rdzv_settings, self.store_conf = split_rdzv_conf(self.rdzv_conf, self.backend)
        #: Suspicious but legal input, one line each; the CLI prints them before the job starts.
        self.warnings: list[str] = [
            f"--rdzv-conf {key}: not a setting of --rdzv-backend {self.backend.name}; ignored"
            for key in unused_rdzv_conf(self.rdzv_conf, self.backend)
        ]
        if self.mode is RendezvousMode.ELASTIC and self.policy is None:
            raise ConfigError(f"--rdzv-backend {self.rdzv_backend}: an elastic job needs its policy (--nnodes)")
        if self.mode is RendezvousMode.STATIC and self.policy is not None:
            raise ConfigError(
                "--elastic-policy and the elastic policy flags need a store-backed rendezvous "
                "(--rdzv-backend c10d or etcd, without --standalone)"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {self.max_restarts}")
        if not (math.isfinite(self.monitor_interval) and self.monitor_interval > 0):
            raise ConfigError(f"--monitor-interval: must be > 0 seconds, got {self.monitor_interval}")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"--start-method: expected one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        if self.max_world_size is not None and self.max_world_size < self.nproc_per_node * self.min_nodes:
            raise ConfigError(
                f"--max-world-size: {self.max_world_size} ranks cannot hold even the minimum "
                f"{self.min_nodes} node(s) x {self.nproc_per_node} rank(s)"
            )
        if self.hang_timeout is not None and not (math.isfinite(self.hang_timeout) and self.hang_timeout >= 0):
            raise ConfigError(f"--hang-timeout: must be >= 0 seconds (0: off), got {self.hang_timeout}")
        if self.spare_ranks not in (0, 1):
            raise ConfigError(
                f"--spare-ranks: must be 0 or 1 (one spare replaces the first failed rank), got {self.spare_ranks}"
            )
        every = self.snapshot_every
        if not is_snapshot_every(every):
            raise ConfigError(
                f"--snapshot-every: must be 'auto' or >= 0 steps (0: no in-memory snapshots), got {every!r}"
            )
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port: must be in 0..65535 (0: off), got {self.metrics_port}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ConfigError(f"--shutdown-timeout: must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.module and self.no_python:
            raise ConfigError("-m/--module and --no-python cannot be used together")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port: must be in 0..65535, got {self.master_port}")
        if not 0 <= self.node_rank:
            raise ConfigError(f"--node-rank: must be >= 0, got {self.node_rank}")
        if self.is_static and self.is_elastic:
            raise ConfigError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: an elastic job needs a rendezvous backend "
                "(--rdzv-backend c10d, embedded or etcd)"
            )
        if self.is_static and self.max_nodes > 1 and self.node_rank >= self.max_nodes:
            raise ConfigError(f"--node-rank: {self.node_rank} is out of range for --nnodes {self.max_nodes}")
        if bad := sorted(r for r in self.local_ranks_filter if not 0 <= r < self.nproc_per_node):
            raise ConfigError(
                f"--local-ranks-filter: local rank(s) {', '.join(map(str, bad))} out of range for "
                f"--nproc-per-node {self.nproc_per_node} (0..{self.nproc_per_node - 1})"
            )
        # Parse eagerly so that a malformed value fails before anything starts.
        self.redirect_map = parse_std(self.redirects, flag="--redirects", nproc=self.nproc_per_node)
        self.tee_map = parse_std(self.tee, flag="--tee", nproc=self.nproc_per_node)
        self._check_entrypoint()

    @property
    def mode(self) -> RendezvousMode:
        """The one place that decides static vs elastic."""
        return RendezvousMode.STATIC if self.is_static or self.standalone else RendezvousMode.ELASTIC

    @property
    def rdzv_host_port(self) -> tuple[str, int]:
        """The first store endpoint as (host, port), with the backend's default port."""
        from hyperpodrun.store.base import parse_endpoint

        first = (self.rdzv_endpoint or f"127.0.0.1:{self.backend.default_port}").split(",")[0]
        return parse_endpoint(first, default_port=self.backend.default_port)

    @property
    def is_static(self) -> bool:
        """Fixed membership given by --node-rank/--master-addr (torchrun's static rendezvous)."""
        return self.rdzv_backend == "static"

    @property
    def is_elastic(self) -> bool:
        return self.max_nodes > self.min_nodes

    def _check_entrypoint(self) -> None:
        if self.module:
            return  # resolved by the interpreter in the worker; errors surface there
        if self.no_python:
            if shutil.which(self.entrypoint) is None and not Path(self.entrypoint).is_file():
                raise ConfigError(f"--no-python: executable {self.entrypoint!r} not found")
            if shutil.which(self.entrypoint) is None and not os.access(self.entrypoint, os.X_OK):
                raise ConfigError(f"--no-python: {self.entrypoint!r} is not executable (chmod +x it)")
            return
        if Path(self.entrypoint).is_dir():
            raise ConfigError(f"training script {self.entrypoint!r} is a directory (use -m to run a package)")
        if not Path(self.entrypoint).is_file():
            raise ConfigError(f"training script {self.entrypoint!r} not found")

    def worker_command(self) -> list[str]:
        """argv of one worker, as torchrun builds it."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [self.python, "-u", "-m", self.entrypoint, *self.args]
        return [self.python, "-u", self.entrypoint, *self.args]


def _default_python() -> str:
    import sys

    return sys.executable


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
