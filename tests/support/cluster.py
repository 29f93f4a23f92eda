"""Several hyperpodrun launchers on this machine forming one elastic job (tests only)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from hyperpodrun.device_plan import DevicePlan
from support.jsonl import read_jsonl
from support.launch import clean_env, hyperpodrun_cmd
from support.ports import free_port

COUNTER = Path(__file__).resolve().parent.parent / "elastic" / "scripts" / "counter.py"
MAX_NODES = 8  # launchers a test starts, at most
#: Ranks per launcher unless a test asks for another count: users' nodes hold several ranks, so a job's scale
#: events and failures are tested with a node's other ranks beside the one that fails, joins or leaves.
NPROC_PER_NODE = 2


def run_rank_scripts(script: Path, world: int, *args: str, timeout: float = 120) -> list[dict]:
    """``world`` processes of ``script RANK WORLD PORT *args`` (rank 0 hosts the store on a free port, src/
    importable); each rank's last line of output, parsed as JSON, in rank order."""
    port, src = free_port(), Path(__file__).resolve().parents[2] / "src"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(port), *args],
            env=clean_env(PYTHONPATH=str(src)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns a truthy value; TimeoutError names what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class ElasticJob:
    """Launchers sharing one run dir, event log and rendezvous endpoint."""

    def __init__(
        self,
        run_dir: Path,
        *,
        backend: str = "c10d",
        endpoint: str | None = None,
        nnodes: str = "1:2",
        flags: tuple[str, ...] = (),
        script: Path = COUNTER,
        script_args: tuple[str, ...] | None = None,
        start_method: str = "forkserver",
        nproc_per_node: int = NPROC_PER_NODE,
    ) -> None:
        if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
        self.run_dir = run_dir
        self.nproc_per_node = nproc_per_node
        self.endpoint = endpoint or f"127.0.0.1:{free_port()}"
        self.events_path = run_dir / "events.jsonl"
        self.base = [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            f"job-{free_port()}",
            "--rdzv-conf",
            "lease_ttl=2,tick=0.1",
            "--scaling-timeout",
            "1",
            "--min-stable-period",
            "1",
            "--faulty-scale-down-timeout",
            "2",
            "--graceful-shutdown-timeout",
            "30",
            "--monitor-interval",
            "0.05",
            # A spare is a process importing torch and what a first step imports (~2.3 CPU-s here, measured) beside
            # the ranks: the tests of spares ask for one (--spare-ranks 1 in their flags, which come later).
            "--spare-ranks",
            "0",
            # Ranks, spares and replacements forked from one server per launcher that imported torch once: the
            # launchers' own tests (tests/launcher) cover the default, fresh processes, beside it.
            "--start-method",
            start_method,
            "--event-log",
            str(self.events_path),
            "--log-dir",
            str(run_dir / "logs"),
            *flags,
        ]
        self.script = [str(script), *(script_args if script_args is not None else (str(run_dir),))]
        self.nodes: dict[str, subprocess.Popen] = {}
        self.devices = DevicePlan.for_host(slots=MAX_NODES, nproc=nproc_per_node)  # GPUs per launcher, or the CPU

    def start_node(
        self, name: str, *extra: str, wrap: Callable[[list[str]], list[str]] | None = None
    ) -> subprocess.Popen:
        """Start a launcher; ``wrap`` runs it elsewhere (e.g. on a support.netns host) and must exec it."""
        out = open(self.run_dir / f"{name}.out", "w")
        err = open(self.run_dir / f"{name}.err", "w")
        cmd = hyperpodrun_cmd(*self.base, *extra, *self.script)
        env = clean_env(**self.devices.env(len(self.nodes) % MAX_NODES))
        proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stdout=out, stderr=err, env=env)
        self.nodes[name] = proc
        # Started in order: the first launcher hosts the embedded store before the next one looks for it.
        wait_until(
            lambda: any(e.get("pid") == proc.pid for e in self.events("agent_started")) or proc.poll() is not None,
            timeout=60,
            what=f"launcher {name} to start",
        )
        return proc

    def stderr(self, name: str) -> str:
        return (self.run_dir / f"{name}.err").read_text()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        records = read_jsonl(self.events_path)
        return [r for r in records if kind is None or r["event"] == kind]

    def progress(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "progress.jsonl")

    def wait_for_world(self, world: int, *, timeout: float = 90, after_step: int = 0) -> int:
        """Wait until training ran a step at ``world`` ranks (after ``after_step``); returns that step."""

        def seen() -> int | None:
            for p in self.progress():
                if p["world"] == world and p["step"] > after_step:
                    return p["step"]
            return None

        return wait_until(seen, timeout=timeout, what=f"a training step at world size {world}")

    def wait_for_nodes(self, nodes: int, *, timeout: float = 90, after_step: int = 0) -> int:
        """Wait until training ran a step on ``nodes`` launchers' ranks (after ``after_step``); returns that step."""
        return self.wait_for_world(self.world(nodes), timeout=timeout, after_step=after_step)

    def world(self, nodes: int) -> int:
        """The world size of ``nodes`` launchers."""
        return nodes * self.nproc_per_node

    def wait_steps(self, n: int, *, timeout: float = 60) -> int:
        start = self.progress()[-1]["step"] if self.progress() else 0
        return wait_until(
            lambda: self.progress() and self.progress()[-1]["step"] >= start + n and self.progress()[-1]["step"],
            timeout=timeout,
            what=f"{n} more training steps",
        )

    def finish(self, *, timeout: float = 60) -> dict[str, int]:
        """Ask the trainer to stop and return each launcher's exit code."""
        (self.run_dir / "stop").touch()
        return {name: p.wait(timeout=timeout) for name, p in self.nodes.items()}

    def signal(self, name: str, sig: int) -> None:
        self.nodes[name].send_signal(sig)

    def kill_node_hard(self, name: str) -> None:
        """kill -9 of a launcher and its whole tree at once (a machine that vanished)."""
        proc = psutil.Process(self.nodes[name].pid)
        tree = [proc, *proc.children(recursive=True)]
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.nodes[name].wait(timeout=30)

    def post_mortem(self, *, events: int = 40, lines: int = 12) -> str:
        """What a failed test leaves for whoever reads CI's output: the run dir, the last ``events`` records of
        the event log (one short line each) and the last ``lines`` of each launcher's stderr."""
        keep = ("ts", "event", "node", "round", "world_size")
        records = self.events()
        t0 = records[0].get("ts", 0.0) if records else 0.0
        out = [f"run dir: {self.run_dir}", f"last {events} of {len(records)} events (seconds from the first):"]
        for r in records[-events:]:
            rest = {k: v for k, v in r.items() if k not in (*keep, "job")}
            head = f"{r.get('ts', t0) - t0:7.2f} {r.get('event')} node={r.get('node')} round={r.get('round')}"
            out.append(f"  {head} world={r.get('world_size')} {json.dumps(rest, default=str)[:240]}")
        for name in self.nodes:
            err = self.run_dir / f"{name}.err"
            tail = err.read_text(errors="replace").splitlines()[-lines:] if err.exists() else []
            out += [f"launcher {name} stderr, last {len(tail)} lines:", *(f"  {line[:240]}" for line in tail)]
        return "\n".join(out)

    def close(self) -> None:
        for proc in self.nodes.values():
            if proc.poll() is None:
                try:
                    for p in psutil.Process(proc.pid).children(recursive=True):
                        p.kill()
                except psutil.NoSuchProcess:
                    pass
                proc.kill()
                proc.wait(timeout=30)
