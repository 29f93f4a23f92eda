"""Rendezvous at scale: N simulated nodes against one etcd, and against the embedded store.

Each simulated node is the launcher's real rendezvous (``ElasticRendezvous`` of
``hyperpodrun.rendezvous.elastic``) on its own store client, without an agent or
trainers: it joins with a leased ``nodes/<id>`` key, the decider (first node in id
order) runs the real policy and publishes ``round`` by compare-and-swap once all N
are alive (policy min = max = N), and every node watches the store until it finds
itself in ``round``. A few client processes drive the nodes from one thread each;
the store runs in a process of its own (etcd, or the embedded server hosted by a
stand-in agent). Every store call is counted by wrapping the node's :class:`Store`.

Measured per (backend, N): time from "go" until every node knows its rank, each
node's latency, and store operations per node, with how both grow with N (log-log
slope). The baseline is the same protocol at N = 8: growth is read against it.

    python benchmarks/rendezvous_scale.py [--quick | --smoke] [--sizes 8,64,256,1024]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import (
    BenchmarkError,
    BenchmarkResult,
    BenchmarkTimeoutError,
    ManagedProcess,
    OutputBus,
    bench_env,
    format_table,
    parse_args,
    percentile,
    pyplot,
    result_tag,
    start_etcd,
)
from hyperpodrun.errors import HyperpodrunError
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.decider import DeciderContext
from hyperpodrun.rendezvous.elastic import ElasticRendezvous
from hyperpodrun.store import (
    EmbeddedStoreClient,
    EmbeddedStoreServer,
    Entry,
    EtcdConfig,
    EtcdStore,
    Lease,
    PrefixedStore,
    Store,
    job_prefix,
)

NAME = "rendezvous_scale"
BACKENDS = ("etcd", "embedded")
SIZES = {"smoke": (8, 32), "quick": (8, 64, 256), "full": (8, 64, 256, 1024)}
LIMIT_S = {"smoke": 60.0, "quick": 120.0, "full": 300.0}
NODES_PER_PROCESS = 256
MAX_PROCESSES = 4
#: Longer than the launcher's default (10 s): hundreds of simulated nodes share a few cores, and a
#: lease keeper starved of CPU for a whole ttl would drop its node, which real nodes (each with
#: its own CPUs) do not. Leases are refreshed every ttl/3, so the refresh load is N*3/ttl ops/s.
LEASE_TTL_S = 60.0
#: Likewise for one store request (the launcher's default is 10 s): a client thread waiting for
#: its turn on a shared core counts against its request's timeout here, not on a real node.
REQUEST_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- client side


class OpCounter:
    """Store operations by kind, shared by a node's rendezvous thread and its lease keeper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def bump(self, op: str) -> None:
        with self._lock:
            self._counts[op] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class CountingLease(Lease):
    """A lease whose refreshes and revocation are counted."""

    def __init__(self, lease: Lease, counter: OpCounter) -> None:
        self.inner = lease
        self._counter = counter

    @property
    def id(self) -> int:
        return self.inner.id

    @property
    def ttl(self) -> float:
        return self.inner.ttl

    def refresh(self) -> None:
        self._counter.bump("lease_refresh")
        self.inner.refresh()

    def revoke(self) -> None:
        self._counter.bump("lease_revoke")
        self.inner.revoke()


def _unwrap(lease: Lease | None) -> Lease | None:
    return lease.inner if isinstance(lease, CountingLease) else lease


class CountingStore(Store):
    """Delegates every call to ``inner`` and counts it by operation."""

    def __init__(self, inner: Store, counter: OpCounter) -> None:
        self.inner = inner
        self.counter = counter

    def get(self, key: str) -> Entry | None:
        self.counter.bump("get")
        return self.inner.get(key)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        self.counter.bump("get_prefix")
        return self.inner.get_prefix(prefix)

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        self.counter.bump("put")
        return self.inner.put(key, value, lease=_unwrap(lease))

    def compare_and_swap(self, key: str, value: bytes, *, expected_revision: int, lease: Lease | None = None) -> bool:
        self.counter.bump("compare_and_swap")
        return self.inner.compare_and_swap(key, value, expected_revision=expected_revision, lease=_unwrap(lease))

    def delete(self, key: str) -> bool:
        self.counter.bump("delete")
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        self.counter.bump("delete_prefix")
        return self.inner.delete_prefix(prefix)

    def grant_lease(self, ttl: float) -> Lease:
        self.counter.bump("grant_lease")
        return CountingLease(self.inner.grant_lease(ttl), self.counter)

    def current_revision(self) -> int:
        self.counter.bump("current_revision")
        return self.inner.current_revision()

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        self.counter.bump("wait_for_change")
        return self.inner.wait_for_change(prefix, after_revision=after_revision, timeout=timeout)

    def close(self) -> None:
        self.inner.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulationSettings:
    """How simulated nodes reach the store and how long they may take."""

    backend: str
    endpoint: str
    run_id: str
    n: int
    limit_s: float
    lease_ttl_s: float = LEASE_TTL_S
    request_timeout_s: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        for name in ("limit_s", "lease_ttl_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def open_store(self) -> Store:
        """A client of the job's store as ``create_store`` builds it, with this request timeout."""
        if self.backend == "etcd":
            config = EtcdConfig(
                endpoints=(self.endpoint,), connect_timeout=60.0, request_timeout=self.request_timeout_s
            )
            inner: Store = EtcdStore(config)
        else:
            inner = EmbeddedStoreClient(self.endpoint, connect_timeout=60.0, request_timeout=self.request_timeout_s)
        return PrefixedStore(inner, job_prefix(self.run_id))


class SimulatedNode:
    """One node: its own store client and the launcher's real rendezvous, without agent or ranks."""

    def __init__(self, index: int, settings: SimulationSettings) -> None:
        self.node_id = f"node-{index:05d}"
        self.counter = OpCounter()
        self.limit_s = settings.limit_s
        self.rdzv = ElasticRendezvous(
            CountingStore(settings.open_store(), self.counter),
            context=DeciderContext(
                policy=ElasticPolicy(min_replicas=settings.n, max_replicas=settings.n),
                nproc_per_node=1,
                max_restarts=0,
                lease_ttl=settings.lease_ttl_s,
                ack_timeout=30.0,
                propagation=1.0,
                tick=0.2,
            ),
            local_addr="127.0.0.1",
            join_timeout=settings.limit_s,
            node_id=self.node_id,
        )
        self.started = 0.0
        self.done: float | None = None
        self.group_rank = -1
        self.ops_at_done: dict[str, int] = {}
        self.error = ""

    def run(self, go: threading.Event) -> None:
        go.wait()
        self.started = time.time()
        try:
            self.rdzv.join()
            info = self.rdzv.next_round(timeout=self.limit_s)
            self.done = time.time()
            self.group_rank = info.assignment.group_rank
        except HyperpodrunError as e:  # recorded per node: one slow node must not hide the others' numbers
            self.error = f"{type(e).__name__}: {e}"
        self.ops_at_done = self.counter.snapshot()

    def report(self) -> dict[str, Any]:
        return {
            "node": self.node_id,
            "started": self.started,
            "done": self.done,
            "group_rank": self.group_rank,
            "ops": self.ops_at_done,
            "error": self.error,
        }


def client_main(args: argparse.Namespace) -> int:
    """A client process: build ``count`` nodes, say READY, run them on GO, report, stop on STOP."""
    settings = SimulationSettings(
        backend=args.backend,
        endpoint=args.endpoint,
        run_id=args.run_id,
        n=args.n,
        limit_s=args.limit,
        lease_ttl_s=args.lease_ttl,
        request_timeout_s=args.request_timeout,
    )
    nodes = [SimulatedNode(i, settings) for i in range(args.first, args.first + args.count)]
    go = threading.Event()
    threads = [threading.Thread(target=node.run, args=(go,), daemon=True) for node in nodes]
    for t in threads:
        t.start()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 2
    go.set()
    deadline = time.monotonic() + args.limit + 15.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    print("RESULT " + json.dumps([node.report() for node in nodes]), flush=True)
    sys.stdin.readline()  # STOP: every process has reported, leaving now cannot disturb a rendezvous
    for node in nodes:
        try:
            node.rdzv.shutdown(succeeded=True)
        except HyperpodrunError as e:  # best effort: the store is torn down next anyway
            print(f"shutdown of {node.node_id}: {e}", file=sys.stderr, flush=True)
    return 0


def serve_embedded_main() -> int:
    """Stand-in for the agent that hosts the embedded store: serve until stdin closes."""
    server = EmbeddedStoreServer("127.0.0.1", 0).start()
    print(f"ENDPOINT {server.endpoint}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.close()
    return 0


# --------------------------------------------------------------------------- driver


def _wait_line(bus: OutputBus, proc: ManagedProcess, prefix: str, *, timeout: float, what: str) -> str:
    """The rest of the first stdout line of ``proc`` starting with ``prefix``; fails fast if it exits."""

    def find(lines: list[Any]) -> tuple[str] | None:
        for line in lines:
            if line.source == proc.name and line.stream == "stdout" and line.text.startswith(prefix):
                return (line.text[len(prefix) :],)
        if proc.poll() is not None:
            raise BenchmarkError(f"{proc.name} exited with {proc.poll()} before {what}:\n{proc.tail()}")
        return None

    return bus.wait_for(find, timeout=timeout, what=what)[0]


def run_one(
    backend: str, n: int, *, limit: float, lease_ttl: float, request_timeout: float, out_dir: Path
) -> dict[str, Any]:
    """One rendezvous of ``n`` nodes; store servers and clients are killed on return."""
    procs: list[ManagedProcess] = []
    bus = OutputBus()
    etcd = None
    script = str(Path(__file__).resolve())
    log_dir = out_dir / "logs" / NAME / f"{backend}_{n}"
    try:
        if backend == "etcd":
            etcd = start_etcd()
            endpoint = etcd.endpoint
        else:
            server = ManagedProcess(
                [sys.executable, script, "--serve-embedded"],
                name="store",
                bus=bus,
                stdin=True,
                log_path=log_dir / "store.log",
            )
            procs.append(server)
            endpoint = _wait_line(bus, server, "ENDPOINT ", timeout=60.0, what="the embedded store's endpoint")
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        op_latency = _op_latency(
            SimulationSettings(backend=backend, endpoint=endpoint, run_id=run_id, n=n, limit_s=limit)
        )
        nprocs = min(MAX_PROCESSES, math.ceil(n / NODES_PER_PROCESS))
        share = [n // nprocs + (1 if i < n % nprocs else 0) for i in range(nprocs)]
        first = 0
        clients = []
        for i, count in enumerate(share):
            cmd = [
                sys.executable,
                script,
                "--client",
                "--backend",
                backend,
                "--endpoint",
                endpoint,
                "--run-id",
                run_id,
                "--n",
                str(n),
                "--first",
                str(first),
                "--count",
                str(count),
                "--limit",
                str(limit),
                "--lease-ttl",
                str(lease_ttl),
                "--request-timeout",
                str(request_timeout),
            ]
            clients.append(
                ManagedProcess(
                    cmd, name=f"client{i}", env=bench_env(), bus=bus, stdin=True, log_path=log_dir / f"client{i}.log"
                )
            )
            first += count
        procs.extend(clients)
        for c in clients:
            _wait_line(bus, c, "READY", timeout=120.0, what=f"{c.name} connecting its {n} node(s) to {backend}")
        store_pid = etcd._proc.pid if etcd is not None else procs[0].pid  # EtcdServer keeps its Popen in _proc
        cpu_before = _cpu_seconds([store_pid]), _cpu_seconds([c.pid for c in clients])
        t0 = time.time()
        for c in clients:
            c.send("GO")
        reports: list[dict[str, Any]] = []
        for c in clients:
            raw = _wait_line(bus, c, "RESULT ", timeout=limit + 60.0, what=f"{c.name}'s rendezvous result")
            reports.extend(json.loads(raw))
        wall = time.time() - t0
        cpu = {
            "store_cpu_s": _cpu_seconds([store_pid]) - cpu_before[0],
            "clients_cpu_s": _cpu_seconds([c.pid for c in clients]) - cpu_before[1],
            "wall_s": wall,
        }
        for c in clients:
            c.send("STOP")
        for c in clients:
            try:
                c.wait(60.0)
            except BenchmarkTimeoutError:
                pass  # killed below; the measurement is already in hand
        return {**_summarize_round(backend, n, t0, reports, limit=limit, processes=nprocs), **cpu, **op_latency}
    finally:
        for p in procs:
            p.close()
        if etcd is not None:
            etcd.stop()


def _op_latency(settings: SimulationSettings, ops: int = 200) -> dict[str, float]:
    """One client's round trip for a ``get`` on an idle store: the unit every node's ops cost."""
    with settings.open_store() as store:
        samples = []
        for _ in range(ops):
            t0 = time.perf_counter()
            store.get("round")
            samples.append(time.perf_counter() - t0)
    return {"idle_get_median_ms": percentile(samples, 50) * 1e3, "idle_get_p99_ms": percentile(samples, 99) * 1e3}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (threads included)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _summarize_round(
    backend: str, n: int, t0: float, reports: list[dict[str, Any]], *, limit: float, processes: int
) -> dict[str, Any]:
    done = [r for r in reports if r["done"] is not None]
    ranks = sorted(r["group_rank"] for r in done)
    latencies = [r["done"] - t0 for r in done]
    ops = [sum(r["ops"].values()) for r in done]
    by_kind: collections.Counter[str] = collections.Counter()
    for r in done:
        by_kind.update(r["ops"])
    complete = len(done) == n and ranks == list(range(n))
    return {
        "backend": backend,
        "n": n,
        "client_processes": processes,
        "limit_s": limit,
        "completed_nodes": len(done),
        "complete": complete,
        "errors": sorted({r["error"] for r in reports if r["error"]})[:5],
        "time_to_all_ranks_s": max(latencies) if complete else None,
        "latency_median_s": percentile(latencies, 50) if latencies else None,
        "latency_p99_s": percentile(latencies, 99) if latencies else None,
        "ops_per_node_median": percentile(ops, 50) if ops else None,
        "ops_per_node_mean": sum(ops) / len(ops) if ops else None,
        "ops_per_node_max": max(ops) if ops else None,
        "ops_by_kind": dict(sorted(by_kind.items())),
        "latencies_s": [round(x, 4) for x in sorted(latencies)],
        "ops_per_node": sorted(ops),
    }


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x): 1 = linear growth, 2 = quadratic."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    var = sum((p[0] - mx) ** 2 for p in pairs)
    return sum((p[0] - mx) * (p[1] - my) for p in pairs) / var if var else None


def plot(result: BenchmarkResult, runs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in BACKENDS:
        rows = [r for r in runs if r["backend"] == backend and r["complete"]]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        ax1.plot(ns, [r["time_to_all_ranks_s"] for r in rows], "o-", label=f"{backend}: all nodes")
        ax1.plot(ns, [r["latency_median_s"] for r in rows], "x--", label=f"{backend}: median node")
        ax2.plot(ns, [r["ops_per_node_mean"] for r in rows], "o-", label=backend)
    for ax, title, ylabel in (
        (ax1, "time until every node knows its rank", "seconds"),
        (ax2, "store operations per node", "operations"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated nodes")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"rendezvous_scale ({result.mode}, {result.machine['logical_cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--sizes",
            type=lambda s: tuple(int(x) for x in s.split(",")),
            default=None,
            help="node counts, e.g. 8,64,256,1024 (default by mode)",
        )
        parser.add_argument("--backends", type=lambda s: tuple(s.split(",")), default=BACKENDS)
        parser.add_argument("--limit", type=float, default=None, help="hard limit per rendezvous, seconds")
        parser.add_argument(
            "--lease-ttl", type=float, default=LEASE_TTL_S, help=f"membership lease ttl, seconds [{LEASE_TTL_S:g}]"
        )
        parser.add_argument(
            "--request-timeout",
            type=float,
            default=REQUEST_TIMEOUT_S,
            help=f"timeout of one store request, seconds [{REQUEST_TIMEOUT_S:g}]",
        )
        # internal roles of this script (client processes and the embedded store's host)
        parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--serve-embedded", action="store_true", help=argparse.SUPPRESS)
        for flag, kind in (
            ("--backend", str),
            ("--endpoint", str),
            ("--run-id", str),
            ("--n", int),
            ("--first", int),
            ("--count", int),
        ):
            parser.add_argument(flag, type=kind, help=argparse.SUPPRESS)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    if args.serve_embedded:
        return serve_embedded_main()
    if args.client:
        return client_main(args)
    for b in args.backends:
        if b not in BACKENDS:
            raise SystemExit(f"--backends: unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    sizes = args.sizes or SIZES[args.mode]
    limit = args.limit or LIMIT_S[args.mode]
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={
            "sizes": list(sizes),
            "backends": list(args.backends),
            "limit_s": limit,
            "nodes_per_client_process": NODES_PER_PROCESS,
            "max_client_processes": MAX_PROCESSES,
            "policy": "min_replicas = max_replicas = N (round published once all N are alive)",
            "lease_ttl_s": args.lease_ttl,
            "request_timeout_s": args.request_timeout,
        },
        baseline="one client's idle store round trip (idle_get_median_ms, measured before each rendezvous), and "
        "the same protocol at the smallest N (growth is read as a log-log slope against it)",
    )
    runs: list[dict[str, Any]] = []
    for backend in args.backends:
        for n in sizes:
            print(f"{NAME}: {backend} N={n} ...", flush=True)
            try:
                run = run_one(
                    backend,
                    n,
                    limit=limit,
                    lease_ttl=args.lease_ttl,
                    request_timeout=args.request_timeout,
                    out_dir=args.out,
                )
            except BenchmarkError as e:
                run = {"backend": backend, "n": n, "complete": False, "errors": [str(e)], "time_to_all_ranks_s": None}
            runs.append(run)
            if not run["complete"]:
                print(f"{NAME}: {backend} N={n} did not complete: {run['errors'][:1]}", flush=True)
                break  # larger N on this backend would only fail slower
    result.samples["runs"] = runs
    summary: dict[str, Any] = {}
    for backend in args.backends:
        rows = [r for r in runs if r["backend"] == backend and r["complete"]]
        ns = [r["n"] for r in rows]
        summary[backend] = {
            "largest_n_completed": max(ns) if ns else 0,
            "time_to_all_ranks_s": {str(r["n"]): r["time_to_all_ranks_s"] for r in rows},
            "ops_per_node_mean": {str(r["n"]): r["ops_per_node_mean"] for r in rows},
            "time_growth_exponent": loglog_slope(ns, [r["time_to_all_ranks_s"] for r in rows]),
            "ops_growth_exponent": loglog_slope(ns, [r["ops_per_node_mean"] for r in rows]),
            "failed_n": [r["n"] for r in runs if r["backend"] == backend and not r["complete"]],
        }
    result.summary = summary
    result.notes.append(
        "Clients, the store and the decider share this machine's CPUs; store_cpu_s and clients_cpu_s "
        "(CPU seconds used during the rendezvous) show which side a run was bound by. On a real cluster "
        "every node has its own CPU, so only the store's share would remain."
    )
    plot(result, runs, result.plot_path(args.out))
    path = result.write(args.out)
    rows = [
        (
            r["backend"],
            r["n"],
            "yes" if r["complete"] else "NO",
            r.get("time_to_all_ranks_s"),
            r.get("latency_median_s"),
            r.get("latency_p99_s"),
            r.get("ops_per_node_mean"),
            r.get("ops_per_node_max"),
            r.get("idle_get_median_ms"),
            r.get("store_cpu_s"),
            r.get("clients_cpu_s"),
        )
        for r in runs
    ]
    print(
        format_table(
            [
                "backend",
                "N",
                "done",
                "all ranks s",
                "median s",
                "p99 s",
                "ops/node",
                "max ops",
                "idle get ms",
                "store CPU s",
                "clients CPU s",
            ],
            rows,
        )
    )
    for backend, s in summary.items():
        print(f"{backend}: time ~ N^{_fmt(s['time_growth_exponent'])}, ops/node ~ N^{_fmt(s['ops_growth_exponent'])}")
    print(f"wrote {path}")
    return 0


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
