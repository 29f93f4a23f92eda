"""A real Slurm cluster of three logical nodes on this machine, for the tests of the Slurm recipe.

    with SlurmCluster(tmp_dir) as cluster:       # installs slurm-wlm and munge first if missing
        job = cluster.sbatch(script, nodes=2, env={...}, output=path)
        cluster.wait_for(job, "COMPLETED", timeout=60)

Debian's ``slurm-wlm`` and ``munge``: a private munged (its own key and socket), one slurmctld and
one ``slurmd -N nX`` per node, each on a loopback port that was free, all state in the given
directory. Node addresses are ``127.0.0.1`` (``NodeAddr``), so jobs reach each other by what
``scontrol show node`` says, with no name resolution. Each node has one CPU: a job owns its nodes,
so a job of a higher-priority partition preempts one of a lower (``preempt/partition_prio``):

* ``main``: the default; never preempted (``PreemptMode=OFF``);
* ``low``: preemptible, ``PreemptMode=REQUEUE`` with ``GraceTime`` :data:`GRACE_TIME` s;
* ``urgent``: a higher ``PriorityTier``; its jobs preempt ``low``'s.

Every daemon, job step and job process carries this cluster's ``SLURM_CONF`` in its environment;
:meth:`SlurmCluster.close` cancels the jobs, stops the daemons and ends whatever still carries it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

import psutil

from support.cluster import wait_until
from support.ports import free_port

__all__ = ["GRACE_TIME", "KILL_WAIT", "NODES", "SlurmCluster", "SlurmError", "ensure_slurm_installed"]

NODES = ("n1", "n2", "n3")
GRACE_TIME = 60  # seconds a preempted job of partition low gets between SIGTERM and SIGKILL
KILL_WAIT = 10  # seconds between SIGTERM and SIGKILL when Slurm kills a job (plain scancel, time limit)
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")


class SlurmError(RuntimeError):
    """The cluster could not be installed or started, or a Slurm command failed; the message says which."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def ensure_slurm_installed(timeout: float = 900.0) -> None:
    """Install Debian's slurm-wlm and munge with apt-get when one of their programs is missing."""
    if all(_which(b) for b in _BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"{' '.join(cmd)} failed: {e}") from None
        if proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    missing = [b for b in _BINARIES if not _which(b)]
    if missing:
        raise SlurmError(f"slurm-wlm and munge are installed but {missing} are not found")


class SlurmCluster:
    """A running local Slurm cluster (see the module's docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        ensure_slurm_installed()
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)
        self._start_munge()
        self._write_conf()
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for node in NODES:
            self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd-{node}")
        wait_until(self._all_idle, timeout=60, what=f"nodes {NODES} to become idle (logs in {self.root / 'log'})")

    def close(self) -> None:
        """Cancel every job, stop the daemons, end what still carries this cluster's SLURM_CONF."""
        if any(d.poll() is None for d in self._daemons):
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
            try:
                wait_until(lambda: not self.squeue(), timeout=KILL_WAIT + 20, what="the jobs to end")
            except (TimeoutError, SlurmError):
                pass  # what is left is ended below
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in self._daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._daemons.clear()
        for p in self._carriers():
            try:
                p.kill()
            except psutil.Error:
                pass

    def _carriers(self) -> list[psutil.Process]:
        """Processes of this machine whose environment names this cluster's configuration."""
        marker = str(self.conf)
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == marker:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def _start_munge(self) -> None:
        d = self.root / "munge"
        key = d / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        self.socket = d / "munge.socket"
        self._daemon(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
            "munged",
        )

        def answers() -> bool:
            return subprocess.run(["munge", "-S", str(self.socket), "-n"], capture_output=True).returncode == 0

        wait_until(answers, timeout=20, what=f"munged to answer on {self.socket}")

    def _write_conf(self) -> None:
        r = self.root
        host = socket.gethostname()
        lines = [
            "ClusterName=hyperpodrun-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for the whole session
            f"KillWait={KILL_WAIT}",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "InactiveLimit=0",
        ]
        for node in NODES:  # one CPU each: a job owns its nodes
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1")
        nodes = ",".join(NODES)
        lines += [
            f"PartitionName=main Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF",
            f"PartitionName=low Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE "
            f"GraceTime={GRACE_TIME}",
            f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon holds it
        try:
            self._daemons.append(
                subprocess.Popen(
                    [_which(cmd[0]) or cmd[0], *cmd[1:]],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        except OSError as e:
            raise SlurmError(f"cannot start {name}: {e}") from None
        finally:
            log.close()

    # -- commands ----------------------------------------------------------------------

    def command(self, *args: str, timeout: float = 30.0) -> str:
        """Run a Slurm client command against this cluster; its stdout (SlurmError on failure)."""
        proc = subprocess.run(
            [_which(args[0]) or args[0], *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def _all_idle(self) -> bool:
        try:
            out = self.command("sinfo", "-h", "-N", "-p", "main", "-o", "%N %T")
        except SlurmError:
            return False
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return sorted(states) == sorted(NODES) and all(s == "idle" for s in states.values())

    def sbatch(
        self,
        script: Path,
        *,
        nodes: int,
        env: Mapping[str, str],
        output: Path,
        cwd: Path,
        options: Iterable[str] = (),
    ) -> str:
        """Submit ``script`` as a user would, its sizes made to fit (no GPUs, one CPU); the job id."""
        args = [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            f"--output={output}",
            "--open-mode=append",  # a requeued job's second run follows its first
            f"--chdir={cwd}",
            *options,
            str(script),
        ]
        proc = subprocess.run(args, env={**self.env, **env}, capture_output=True, text=True, timeout=30, cwd=cwd)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch {script} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.command("scontrol", "show", "job", "-o", job_id)
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def squeue(self) -> list[str]:
        return self.command("squeue", "-h", "-o", "%i").split()

    def wait_for(self, job_id: str, *states: str, timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; its fields then."""
        fields: dict[str, str] = {}

        def reached() -> bool:
            nonlocal fields
            fields = self.job(job_id)
            return fields.get("JobState") in states

        wait_until(reached, timeout=timeout, what=f"job {job_id} to reach {states}", interval=0.5)
        return fields

    def scancel(self, *job_ids: str, sig: signal.Signals | None = None) -> None:
        self.command("scancel", *([f"--signal={sig.name.removeprefix('SIG')}"] if sig else []), *job_ids)
