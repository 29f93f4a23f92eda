"""Prometheus metrics of one agent, fed by its event log (``hyperpodrun --metrics-port``).

:class:`AgentMetrics` is an :class:`~hyperpodrun.events.EventLog` *sink*: it sees
every record the agent (and, through the agent, nothing else) logs and turns them
into metrics, so it needs no access to the agent's internals. Two more feeds:

* :meth:`AgentMetrics.observe_progress` — the ranks' step counts and seconds per
  step, as the agent reads them off the control channel;
* :meth:`AgentMetrics.instrument_store` — wraps any :class:`~hyperpodrun.store.Store`
  and times each call.

Downtime of a scale event is read off its phase records, as the event log defines
them: from ``scale_decided`` through ``workers_signalled``, ``checkpoint_saved``,
``workers_stopped``, ``rendezvous_done``, ``workers_started``,
``checkpoint_loaded`` to ``first_step``. Each phase's histogram observes the time
since the previous phase seen for the same event; the event's downtime is
``first_step - scale_decided``. Records of the trainer (``checkpoint_*``,
``first_step``) reach an agent's sink only if that agent logs them; agents read
them from the shared event log file otherwise, so only the phases an agent saw
are observed. See docs/observability.md for the full list.

:func:`serve` starts the HTTP endpoint (loopback unless told otherwise).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from hyperpodrun.errors import ConfigError
from hyperpodrun.store.base import Entry, Lease, Store, StoreError

__all__ = ["PHASES", "AgentMetrics", "InstrumentedStore", "MetricsError", "MetricsServer", "TrainerRecords", "serve"]

PREFIX = "hyperpodrun"
#: Phases of a scale event, in order (DESIGN.md, event log contract).
PHASES = (
    "scale_decided",
    "workers_signalled",
    "checkpoint_saved",
    "workers_stopped",
    "rendezvous_done",
    "workers_started",
    "checkpoint_loaded",
    "first_step",
)
_DOWNTIME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_PROGRESS_RANKS = 1024  # label values are local ranks; a node never has more


class MetricsError(ConfigError):
    """The metrics endpoint cannot be served as asked."""


class AgentMetrics:
    """One agent's metrics, in their own registry (several agents may share a process in tests)."""

    def __init__(
        self, *, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        r = self.registry
        self.world_size = Gauge(f"{PREFIX}_world_size", "Ranks in the job's current round", registry=r)
        self.round = Gauge(f"{PREFIX}_round", "Current rendezvous round", registry=r)
        self.members = Gauge(f"{PREFIX}_members", "Nodes (replicas) in the current round", registry=r)
        self.standbys = Gauge(
            f"{PREFIX}_standbys", "Nodes waiting as standbys (from records that list them)", registry=r
        )
        self.scale_events = Counter(
            f"{PREFIX}_scale_events", "Scale events decided, by kind and mode", ["kind", "mode"], registry=r
        )
        self.downtime = Histogram(
            f"{PREFIX}_scale_downtime_seconds",
            "Time from a scale decision to the first step of the new round",
            ["kind"],
            buckets=_DOWNTIME_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            f"{PREFIX}_scale_phase_seconds",
            "Time of each phase of a scale event (since the previous phase)",
            ["phase"],
            buckets=_DOWNTIME_BUCKETS,
            registry=r,
        )
        self.steps_lost = Counter(
            f"{PREFIX}_steps_lost",
            "Training steps lost to stops without a save (since the round's last checkpoint)",
            registry=r,
        )
        self.restarts = Counter(f"{PREFIX}_restarts", "Worker group restarts, by reason", ["reason"], registry=r)
        self.worker_failures = Counter(f"{PREFIX}_worker_failures", "Worker ranks that failed", registry=r)
        self.ranks_replaced = Counter(
            f"{PREFIX}_ranks_replaced", "Failed ranks restarted alone, to be repaired in place", registry=r
        )
        self.nodes_lost = Counter(f"{PREFIX}_nodes_lost", "Nodes lost (lease expired)", registry=r)
        self.store_lost = Counter(f"{PREFIX}_store_lost", "Times this agent lost its store", registry=r)
        self.rank_steps = Gauge(
            f"{PREFIX}_rank_steps", "Steps of each local rank in this round", ["local_rank"], registry=r
        )
        self.rank_step_rate = Gauge(
            f"{PREFIX}_rank_step_rate", "Steps per second of each local rank (recent)", ["local_rank"], registry=r
        )
        self.store_latency = Histogram(
            f"{PREFIX}_store_request_seconds",
            "Latency of store calls, by operation",
            ["op"],
            buckets=_STORE_BUCKETS,
            registry=r,
        )
        self.store_errors = Counter(f"{PREFIX}_store_errors", "Failed store calls, by operation", ["op"], registry=r)
        self._event: dict[str, Any] | None = None  # the scale event in progress: kind, start, last phase time
        self._round_steps = 0  # highest rank step seen in this round
        self._saved_steps = 0  # rank step at the round's last checkpoint_saved
        self._ranks = 0
        self._lock = threading.Lock()  # the agent, its rendezvous and the trainer-record reader all feed us

    # ------------------------------------------------------------------ event sink
    def __call__(self, record: dict[str, Any]) -> None:
        """The EventLog sink: update the metrics from one record (never raises on odd records)."""
        with self._lock:
            self._record(record)

    def _record(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        ts = record.get("ts")
        ts = float(ts) if isinstance(ts, (int, float)) else self._clock()
        if isinstance(record.get("round"), int):
            self.round.set(record["round"])
        if event == "rendezvous_done":
            self.members.set(len(record.get("members") or ()))
        if isinstance(record.get("standbys"), (list, tuple)):  # any record that lists the standbys
            self.standbys.set(len(record["standbys"]))
        if event in ("rendezvous_done", "workers_started") and isinstance(record.get("world_size"), int):
            self.world_size.set(record["world_size"])
        if event == "scale_decided":
            self._on_decided(record, ts)
        elif event in PHASES:
            self._on_phase(event, record, ts)
        if event == "workers_started":
            reason = str(record.get("reason", "start"))
            if reason != "start":
                self.restarts.labels(reason=reason).inc()
            self._round_steps = self._saved_steps = 0
        elif event == "scale_targeted":
            self.scale_events.labels(
                kind=str(record.get("kind", "unknown")), mode=str(record.get("mode", "restart"))
            ).inc()
        elif event == "worker_failed":
            self.worker_failures.inc()
        elif event == "ranks_replaced":
            self.ranks_replaced.inc(len(record.get("ranks") or ()))
        elif event == "node_lost":
            self.nodes_lost.inc()
        elif event == "store_lost":
            self.store_lost.inc()

    def _on_decided(self, record: dict[str, Any], ts: float) -> None:
        kind = str(record.get("kind", "unknown"))
        mode = str(record.get("mode", "restart"))
        if mode == "stop":  # ranks stopped without a save: what they trained since the last checkpoint is lost
            self.scale_events.labels(kind=kind, mode=mode).inc()
            self.steps_lost.inc(max(0, self._round_steps - self._saved_steps))
        # a cooperative event is counted once its mode is settled (scale_targeted: reconfigure or restart)
        self._event = {"kind": kind, "start": ts, "last": ts, "index": 0, "round": record.get("round", 0)}

    def _on_phase(self, event: str, record: dict[str, Any], ts: float) -> None:
        if event == "checkpoint_saved":
            self._saved_steps = self._round_steps
        ev = self._event
        if ev is None and event == "workers_signalled":  # another agent decided: the event starts here for us
            ev = self._event = {
                "kind": str(record.get("event_kind") or "unknown"),
                "start": ts,
                "last": ts,
                "index": 1,
                "round": record.get("round", 0),
            }
            return
        if ev is None:
            return
        index = PHASES.index(event)
        if index < ev["index"]:
            return  # an earlier phase logged late (another node's record): nothing to time
        if event in ("checkpoint_loaded", "first_step") and record.get("round", 0) <= ev["round"]:
            return  # the trainer's record of the round before the event, read late
        self.phase.labels(phase=event).observe(max(0.0, ts - ev["last"]))
        ev["last"], ev["index"] = ts, index
        if event == "first_step":
            self.downtime.labels(kind=ev["kind"]).observe(max(0.0, ts - ev["start"]))
            self._event = None

    # ------------------------------------------------------------------ progress
    def observe_progress(self, steps: Sequence[int], step_times: Sequence[float]) -> None:
        """The local ranks' step counts and seconds per step (0: unknown), from the control channel."""
        with self._lock:
            self._progress(steps, step_times)

    def _progress(self, steps: Sequence[int], step_times: Sequence[float]) -> None:
        for r in range(len(steps), min(self._ranks, _PROGRESS_RANKS)):  # fewer ranks than before: drop the rest
            self.rank_steps.remove(str(r))
            self.rank_step_rate.remove(str(r))
        self._ranks = len(steps)
        for r, (step, seconds) in enumerate(zip(steps, step_times)):
            self.rank_steps.labels(local_rank=str(r)).set(step)
            self.rank_step_rate.labels(local_rank=str(r)).set(1.0 / seconds if seconds > 0 else 0.0)
        if steps:
            self._round_steps = max(self._round_steps, max(steps))

    # ------------------------------------------------------------------ store
    def instrument_store(self, store: Store) -> InstrumentedStore:
        return InstrumentedStore(store, self)

    def _timed(self, op: str, fn: Callable[[], Any]) -> Any:
        start = self._clock()
        try:
            return fn()
        except StoreError:
            self.store_errors.labels(op=op).inc()
            raise
        finally:
            self.store_latency.labels(op=op).observe(max(0.0, self._clock() - start))


class InstrumentedStore(Store):
    """A :class:`Store` that times every call of the store it wraps (``wait_for_change`` excepted: it blocks by design)."""

    def __init__(self, inner: Store, metrics: AgentMetrics) -> None:
        self.inner = inner
        self._m = metrics

    def get(self, key: str) -> Entry | None:
        return self._m._timed("get", lambda: self.inner.get(key))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        return self._m._timed("get_prefix", lambda: self.inner.get_prefix(prefix))

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        return self._m._timed("put", lambda: self.inner.put(key, value, lease=lease))

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        return self._m._timed(
            "compare_and_swap",
            lambda: self.inner.compare_and_swap(key, value, expected_revision=expected_revision, lease=lease),
        )

    def delete(self, key: str) -> bool:
        return self._m._timed("delete", lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        return self._m._timed("delete_prefix", lambda: self.inner.delete_prefix(prefix))

    def grant_lease(self, ttl: float) -> Lease:
        return self._m._timed("grant_lease", lambda: self.inner.grant_lease(ttl))

    def current_revision(self) -> int:
        return self._m._timed("current_revision", lambda: self.inner.current_revision())

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        try:
            return self.inner.wait_for_change(prefix, after_revision=after_revision, timeout=timeout)
        except StoreError:
            self._m.store_errors.labels(op="wait_for_change").inc()
            raise

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # backend extras (e.g. the embedded store's host flag)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"InstrumentedStore({self.inner!r})"


class TrainerRecords:
    """Hands the trainer's records of the event log file (``source: trainer``) to a sink.

    The ranks append ``first_step``, ``checkpoint_saved`` and ``checkpoint_loaded``
    to the agent's event log file themselves (``HYPERPODRUN_EVENT_LOG``), so they
    never pass through the agent's :class:`~hyperpodrun.events.EventLog`. This
    thread reads what is appended after it started, every ``interval`` seconds.
    """

    def __init__(
        self, path: Path, sink: Callable[[dict[str, Any]], None], *, job: str | None = None, interval: float = 0.2
    ) -> None:
        self.path = Path(path)
        self.job = job
        self._sink = sink
        self._interval = interval
        self._stop = threading.Event()
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0
        self._partial = b""
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-metrics-trainer-records", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Read what was appended since the last poll and feed the trainer's complete lines to the sink."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("source") == "trainer" and self.job in (None, record.get("job")):
                self._sink(record)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MetricsServer:
    """The HTTP endpoint serving a registry in Prometheus text format."""

    def __init__(self, registry: CollectorRegistry, *, addr: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            raise MetricsError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {e.strerror or e}") from None
        self.addr = addr
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(metrics: AgentMetrics, *, addr: str = "127.0.0.1", port: int) -> MetricsServer:
    """Serve ``metrics`` on ``addr:port`` (port 0: any free port; see :attr:`MetricsServer.port`)."""
    return MetricsServer(metrics.registry, addr=addr, port=port)
