"""The soak's job: hyperpodrun launchers of the example trainer under one etcd, and the faults it injects.

One :class:`SoakJob` is one training run (its own ``--rdzv-id``, run dir, logs): launchers are
started and stopped as simulated nodes (``ranks_per_node`` ranks each), events are injected by :meth:`SoakJob.inject`,
and the waits read rank 0's per-step metrics and the job's event log, each with a deadline that
names what it waited for.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from common import (
    REPO_ROOT,
    BenchmarkError,
    ManagedProcess,
    OutputBus,
    TrainArgs,
    bench_env,
    hyperpodrun_cmd,
    read_metrics,
    require_train_script,
)
from hyperpodrun.device_plan import DevicePlan

__all__ = ["JobDied", "SoakJob", "SoakSettings"]

EXAMPLE_DIR = REPO_ROOT / "examples" / "llama_finetune"
MAX_LAUNCHERS = 4  # alive at once: up to 3 members (--nnodes 1:3) and a standby


class JobDied(BenchmarkError):
    """Every launcher of the job exited, or it did not recover in time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakSettings:
    """The training run and the launchers' timers of every soak job."""

    steps: int
    data_cache: Path
    step_time_s: float = 0.3
    ckpt_every: int = 5
    model: str = "tiny"  # the example's preset
    seq_len: int = 64
    ranks_per_node: int = 2
    global_batch: int = 12  # 3, 2 or 1 nodes of 2 ranks: 2, 3 or 6 samples per rank
    micro_batch: int = 2
    seed: int = 0
    # the example's --deterministic-reduce: gradients summed in an order fixed by batch positions, so every world
    # size (and every event) trains the same bits as the reference; without it the all-reduce's order differs by
    # world size, and this training grows those last-bit differences ~10x every 10 steps (fp64 starts them at 1e-16)
    deterministic_reduce: bool = True
    dtype: str = "fp32"
    lease_ttl_s: float = 6.0  # longer than an etcd pause (2-4 s): a pause must not cost the leases
    hang_timeout_s: float = 10.0
    event_timeout_s: float = 120.0
    startup_timeout_s: float = 240.0
    settle_steps: int = 2
    tail_steps: int = 6
    pause_s: tuple[float, float] = (2.0, 4.0)

    def __post_init__(self) -> None:
        for name in ("steps", "ranks_per_node", "ckpt_every", "seq_len", "global_batch", "micro_batch", "settle_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.global_batch % (6 * self.ranks_per_node):
            raise ValueError(
                f"global_batch must split evenly over the ranks of 1, 2 and 3 nodes of {self.ranks_per_node}, "
                f"got {self.global_batch}"
            )
        if self.dtype not in ("fp64", "fp32"):
            raise ValueError(f"dtype must be fp64 or fp32, got {self.dtype!r}")
        if not self.pause_s[1] < self.lease_ttl_s:
            raise ValueError(f"pause_s {self.pause_s} must end before the lease ttl {self.lease_ttl_s}")

    def train_args(self, work: Path) -> list[str]:
        train = TrainArgs(
            steps=self.steps,
            model=self.model,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            min_step_time=self.step_time_s,
            ckpt_every=self.ckpt_every,
            extra=(
                "--seed",
                str(self.seed),
                "--dtype",
                self.dtype,
                "--sample-log",
                str(work / "samples.jsonl"),
                "--save-final",
                str(work / "final.pt"),
                "--keep-checkpoints",
                "2",
                *(("--deterministic-reduce",) if self.deterministic_reduce else ()),
            ),
        )
        return train.argv(run_dir=work / "run", data_cache=self.data_cache, metrics=work / "metrics.jsonl")

    def expected_batches(self) -> Callable[[int], list[int]]:
        """Step -> the sample ids of its global batch (the epoch permutation); tokenises the data once."""
        if str(EXAMPLE_DIR) not in sys.path:
            sys.path.insert(0, str(EXAMPLE_DIR))
        import torch
        from train import Runtime, TrainConfig, prepare_dataset

        from elastic_events.data.dataset import ByteTokenizer
        from elastic_events.data.sampler import epoch_permutation

        rt = Runtime(
            rank=0,
            local_rank=0,
            world_size=1,
            device=torch.device("cpu"),
            compute_dtype=torch.float32,
            distributed=False,
        )
        config = TrainConfig(data_cache=self.data_cache, seq_len=self.seq_len, num_workers=0)
        num_samples = len(prepare_dataset(config, ByteTokenizer(), rt))
        per_epoch = num_samples // self.global_batch * self.global_batch

        @functools.lru_cache(maxsize=4)
        def permutation(epoch: int) -> list[int]:
            return epoch_permutation(num_samples, seed=self.seed, epoch=epoch).tolist()

        def expected(step: int) -> list[int]:
            epoch, position = divmod((step - 1) * self.global_batch, per_epoch)
            return permutation(epoch)[position : position + self.global_batch]

        return expected

    def as_params(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


class SoakJob:
    """The launchers of one run; nodes are named ``node-0``, ``node-1``, ... in start order."""

    def __init__(self, settings: SoakSettings, *, restart_mode: str, etcd: Any, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.settings, self.etcd, self.work = settings, etcd, work
        self.run_id = f"soak-{work.name}-{os.getpid()}"
        self.final = work / "final.pt"
        self.bus = OutputBus()
        self.nodes: dict[str, ManagedProcess] = {}
        self.expected_exit: set[str] = set()  # nodes we stopped (SIGTERM, kill -9): their exit is no failure
        self.t_start = 0.0
        self.script = str(require_train_script())
        self.flags = [
            "--nnodes",
            "1:3",
            "--nproc-per-node",
            str(settings.ranks_per_node),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            etcd.endpoint,
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            f"lease_ttl={settings.lease_ttl_s:g}",
            "--scaling-timeout",
            "1",
            "--min-stable-period",
            "1",
            "--faulty-scale-down-timeout",
            "0",
            "--backoff-factor",
            "1",
            "--graceful-shutdown-timeout",
            "60",
            "--max-restarts",
            "1000",
            "--hang-timeout",
            f"{settings.hang_timeout_s:g}",
            "--monitor-interval",
            "0.1",
            "--restart-mode",
            restart_mode,
            "--event-log",
            str(work / "events.jsonl"),
        ]
        self.env = bench_env(OMP_NUM_THREADS="1")
        # a GPU per launcher alive at a time (members and standbys), or every launcher on the CPU
        self.devices = DevicePlan.for_host(slots=MAX_LAUNCHERS, nproc=settings.ranks_per_node)
        self.slots: dict[str, int] = {}
        if (note := self.devices.note()) is not None:
            print(f"soak: {note}", flush=True)

    # -- logs

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.work / "metrics.jsonl")

    def samples(self) -> list[dict[str, Any]]:
        return read_metrics(self.work / "samples.jsonl")

    def events(self) -> list[dict[str, Any]]:
        return read_metrics(self.work / "events.jsonl")

    def sample_lines(self) -> int:
        return len(self.samples())

    def last_step(self) -> int:
        records = self.metrics()
        return records[-1]["step"] if records else 0

    def round(self) -> int:
        return max((e["round"] for e in self.events() if e["event"] == "rendezvous_done"), default=0)

    def time_to_step(self, step: int) -> float | None:
        done = [r["ts"] for r in self.metrics() if r["step"] == step]
        return done[-1] - self.t_start if done else None

    def tails(self) -> str:
        return "\n".join(node.tail(6) for node in self.nodes.values())

    # -- nodes

    def start(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = f"node-{len(self.nodes)}"
            logs = ("--log-dir", str(self.work / "logs" / name))  # one per node: attempt folders would collide
            cmd = hyperpodrun_cmd(*self.flags, *logs, self.script, *self.settings.train_args(self.work))
            free = sorted(set(range(MAX_LAUNCHERS)) - {self.slots[n] for n in self.alive()})
            if not free:
                raise BenchmarkError(f"more than {MAX_LAUNCHERS} launchers alive at once")
            self.slots[name] = free[0]
            env = {**self.env, **self.devices.env(free[0])}
            self.nodes[name] = ManagedProcess(cmd, name=name, env=env, bus=self.bus, log_path=self.work / f"{name}.log")
            self.t_start = self.t_start or self.nodes[name].started_at
            names.append(name)
        return names

    def alive(self) -> list[str]:
        return [name for name, node in self.nodes.items() if node.poll() is None]

    def alive_count(self) -> int:
        return len(self.alive())

    def members(self) -> list[str]:
        """The nodes of the newest round (by launcher pid in the node ids), alive ones only."""
        done = [e for e in self.events() if e["event"] == "rendezvous_done"]
        if not done:
            return self.alive()
        ids = max(done, key=lambda e: e["round"]).get("members") or []
        pids = {str(node_id).rsplit("-", 1)[-1] for node_id in ids}
        return [name for name in self.alive() if str(self.nodes[name].pid) in pids] or self.alive()

    def rank_pids(self, name: str) -> list[int]:
        """The pids of ``name``'s rank processes, once all of them run (empty before)."""
        try:
            children = psutil.Process(self.nodes[name].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        running = {}  # pid -> parent pid, of every process running the script (ranks and their data workers)
        for child in children:
            try:
                if self._runs_script(child):
                    running[child.pid] = child.ppid()
            except psutil.NoSuchProcess:
                continue
        pids = sorted(pid for pid, parent in running.items() if parent not in running)  # not a rank's own child
        return pids if len(pids) == self.settings.ranks_per_node else []

    def _runs_script(self, proc: psutil.Process) -> bool:
        """``python [-u] script ...``: a rank or one of its data workers, not the pre-warmed spare (``-m ...``)."""
        return self.script in proc.cmdline()[:3]

    def still_running(self, pids: list[int]) -> bool:
        """Whether every pid is still a rank process of this job (not exited, not reused)."""
        for pid in pids:
            try:
                if not self._runs_script(psutil.Process(pid)):
                    return False
            except psutil.NoSuchProcess:
                return False
        return True

    def ctl(self, *args: str) -> str:
        cmd = [
            sys.executable,
            "-m",
            "hyperpodrun.ctl",
            *args,
            "--rdzv-id",
            self.run_id,
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            self.etcd.endpoint,
        ]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise BenchmarkError(f"hyperpodctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    # -- events

    def inject(self, kind: str, rng: random.Random) -> dict[str, Any]:
        """Do ``kind`` to the job now; returns what was done (node, pid, pause length)."""
        if kind == "join":
            return {"node": self.start(1)[0]}
        if kind in ("yield", "uncap"):
            self.ctl(*(("yield", "1") if kind == "yield" else ("uncap",)))
            return {}
        if kind == "etcd_restart":
            self.etcd.restart()
            return {}
        if kind == "etcd_pause":
            pause = rng.uniform(*self.settings.pause_s)
            self.etcd.pause()
            time.sleep(pause)  # the fault itself lasts this long; nothing to wait on
            self.etcd.resume()
            return {"pause_s": pause}
        name = rng.choice(sorted(self.members()))
        if kind == "leave":
            self.expected_exit.add(name)
            self.nodes[name].signal(signal.SIGTERM)
            return {"node": name}
        if kind == "kill_node":
            self.expected_exit.add(name)
            self.nodes[name].kill_tree()
            return {"node": name}
        pids = self._poll(lambda: self.rank_pids(name), timeout=30, what=f"the rank processes of {name}")
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL if kind == "kill_rank" else signal.SIGSTOP)
        return {"node": name, "pid": pid, "siblings": [p for p in pids if p != pid]}

    # -- waits

    def _poll(self, predicate: Callable[[], Any], *, timeout: float, what: str) -> Any:
        def check(_: object) -> Any:
            if not self.alive():
                codes = {name: node.poll() for name, node in self.nodes.items()}
                raise JobDied(f"every launcher exited ({codes}) while waiting for {what}")
            return predicate()

        return self.bus.wait_for(check, timeout=timeout, what=what)

    def wait_step(self, step: int, *, timeout: float) -> None:
        self._poll(lambda: self.last_step() >= step, timeout=timeout, what=f"training to reach step {step}")

    def wait_progress(self, *, world: int | None, after: float, timeout: float, what: str) -> float:
        return self.wait_recovery(
            world=world, round_after=None, after=after, settle=self.settings.settle_steps, timeout=timeout, what=what
        )

    def wait_recovery(
        self, *, world: int | None, round_after: int | None, after: float, settle: int, timeout: float, what: str
    ) -> float:
        """Until rank 0 logged ``settle`` steps at ``world`` after ``after`` (and after a round newer
        than ``round_after``); returns when the first of the steps at ``world`` since then ended."""

        def ready() -> float | None:
            t0 = after
            if round_after is not None:
                rounds = [
                    e["ts"] for e in self.events() if e["event"] == "rendezvous_done" and e["round"] > round_after
                ]
                if not rounds:
                    return None
                t0 = max(t0, min(rounds))
            recent = [r for r in self.metrics() if r["ts"] > t0]
            run = []
            for r in reversed(recent):
                if world is not None and r["world_size"] != world:
                    break
                run.append(r)
            return run[-1]["ts"] if len(run) >= settle else None

        return self._poll(ready, timeout=timeout, what=f"{settle} steps at world {world} after {what}")

    def restart_after_death(self, state: Any) -> None:
        """Start the job again from its checkpoint with 3 fresh launchers (and no cap)."""
        for node in self.nodes.values():
            node.close()
        self.expected_exit.update(self.nodes)
        if state.capped:
            self.ctl("uncap")
        self.start(3)
        self.wait_progress(
            world=None, after=time.time(), timeout=self.settings.startup_timeout_s, what="the restart of a dead job"
        )
        state.nodes, state.world, state.capped = 3, 3 * self.settings.ranks_per_node, False

    def close(self, grace: float = 60.0) -> dict[str, int | None]:
        """Wait up to ``grace`` for the launchers to finish on their own, then kill the rest; exit codes."""
        deadline = time.monotonic() + grace
        for node in self.nodes.values():
            try:
                node.wait(max(0.1, deadline - time.monotonic()))
            except BenchmarkError:
                pass
        codes = {name: node.poll() for name, node in self.nodes.items()}
        for node in self.nodes.values():
            node.close()
        return {name: (code if name not in self.expected_exit else f"stopped ({code})") for name, code in codes.items()}
