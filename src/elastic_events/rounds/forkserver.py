"""A node's fork server: one interpreter that imports torch once and forks the node's ranks from it.

``hyperpodrun --start-method forkserver`` starts one per node (:mod:`hyperpodrun.forkserver` is its
client). It imports what every rank imports (torch, ``torch.distributed`` and what the first step
imports, :func:`~elastic_events.rounds.joining.prewarm`: 3-4 CPU-seconds a rank on a CPU) and initialises
no accelerator (:func:`accelerator_initialised` is checked before each fork); each rank, spare and
replacement is then a fork of it that starts in milliseconds.

Protocol, over the ``AF_UNIX``/``SOCK_SEQPACKET`` socket inherited as the file descriptor in ``argv``:

- server → launcher, once imported: ``{"ready": pid}``;
- launcher → server: ``{"argv": [...], "env": {...}, "cwd": "..."}`` with the rank's stdout and stderr
  as two attached descriptors;
- server → launcher: ``{"pid": N}``, or ``{"refused": "why"}`` when the command is not one a fork can run
  as ``python`` would (the launcher then starts a fresh process).

A rank is forked twice (server → intermediate → rank) and the intermediate exits at once, so the rank
is re-parented to the launcher (a child subreaper): the launcher waits for it, signals it and reads its
exit status as for a child of its own. The rank then runs in its own session with
``PR_SET_PDEATHSIG=SIGKILL`` towards the launcher, takes its environment, working directory,
``sys.argv`` and ``sys.path[0]``, and runs the script (``runpy``, ``__main__``); it exits as the
interpreter does after a script (atexit handlers, non-daemon threads joined, files flushed).

What differs from a fresh ``python`` process, by construction: the modules above are already imported
(an environment variable read at their import time is the server's, which is why a command whose
``PYTHON*``, ``LD_*`` or thread-pool variables differ from the server's is refused); the process's
command line and ``/proc/<pid>/environ`` are the server's; the string-hash seed is shared by the node's
ranks. Python's, torch's and NumPy's global random generators are seeded in each rank from the OS, as in a
fresh process. A job that sets no thread count has the server import torch with OpenMP at one thread (so it
stays forkable) and each rank set the count a fresh interpreter picks.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RankJob", "accelerator_initialised", "main", "refusal", "server_command"]

USAGE = "python -u -m elastic_events.rounds.forkserver SOCKET_FD"
#: Variables read when the interpreter or a native library starts: a rank must have the server's values.
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_")
MAX_MESSAGE = 1 << 20
#: How long a forked rank waits for its re-parenting to the launcher (the intermediate's exit).
REPARENT_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


def server_command(python: str, fd: int) -> list[str]:
    return [python, "-u", "-m", "elastic_events.rounds.forkserver", str(fd)]


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """What a forked rank runs: ``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS``."""

    script: str | None
    module: str | None
    args: tuple[str, ...]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> RankJob | str:
        """The job of a worker's argv, or why a fork cannot run it as that command would."""
        if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return f"not this interpreter ({argv[0] if argv else '(empty)'!r} vs {sys.executable!r})"
        if len(argv) < 3 or argv[1] != "-u":
            return f"not run as python -u ({' '.join(argv[1:3])!r})"
        if argv[2] == "-m":
            if len(argv) < 4:
                return "-m without a module"
            return cls(script=None, module=argv[3], args=tuple(argv[4:]))
        if argv[2].startswith("-"):
            return f"interpreter option {argv[2]!r}"
        return cls(script=argv[2], module=None, args=tuple(argv[3:]))


def refusal(argv: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> str | None:
    """Why a fork of this server cannot run ``argv`` with ``env`` as a fresh interpreter would; None if it can."""
    job = RankJob.from_argv(argv)
    if isinstance(job, str):
        return job
    for name in sorted(set(env) | set(server_env)):
        if name.startswith(STARTUP_PREFIXES) and env.get(name) != server_env.get(name):
            return f"{name} differs from the fork server's (read when the interpreter starts)"
    return None


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


#: What ``cuDeviceGetCount`` answers before ``cuInit``: the driver is loaded but not initialised.
CUDA_ERROR_NOT_INITIALIZED = 3


def _own_maps() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return maps.readlines()
    except OSError:
        return []


def accelerator_initialised(
    maps: Callable[[], Sequence[str]] = _own_maps,
    driver: Callable[[str], Any] = ctypes.CDLL,
) -> bool:
    """The CUDA driver is initialised in this process (``cuInit`` ran): a forked child could not use the device.

    A driver that is only loaded does not stop a fork: what the server imports can map ``libcuda.so`` (it
    was mapped in the server with torch 2.11+cu130 on an H200), and each forked rank then initialises its
    own. The loaded driver is asked without being initialised: before ``cuInit``, ``cuDeviceGetCount``
    answers ``CUDA_ERROR_NOT_INITIALIZED``. A driver that is mapped but cannot be asked counts as
    initialised (the rank then starts fresh).
    """
    path = next((line.split()[-1] for line in maps() if "libcuda.so" in line), None)
    if path is None:
        return False
    try:
        count = ctypes.c_int()
        answer = driver(path).cuDeviceGetCount(ctypes.byref(count))
    except (OSError, AttributeError):
        return True
    return answer != CUDA_ERROR_NOT_INITIALIZED


@dataclass(frozen=True, kw_only=True)
class _Startup:
    """The server's environment as it started, and whether it imported torch with OpenMP pinned to one thread."""

    env: Mapping[str, str]
    openmp_pinned: bool


def _pin_openmp() -> _Startup:
    """Have the imports start no OpenMP worker when the job sets no thread count.

    A fork keeps only the thread that forks, so a server with an OpenMP worker could fork no rank (importing
    torch starts one unless ``OMP_NUM_THREADS=1``). libgomp reads the variable once, when torch loads it, so it
    is set in the server's own environment before that; each forked rank then gets the count a fresh
    interpreter would have picked (:func:`_openmp_threads_of_a_fresh_process`)."""
    env = dict(os.environ)
    pinned = not any(name in env for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    if pinned:
        os.environ["OMP_NUM_THREADS"] = "1"
    return _Startup(env=env, openmp_pinned=pinned)


def _openmp_threads_of_a_fresh_process() -> int:
    """libgomp's default without ``OMP_NUM_THREADS``: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def _preload() -> None:
    import torch  # noqa: F401 - what the server exists to import once
    import torch.distributed  # noqa: F401

    from elastic_events.rounds.joining import prewarm

    prewarm()


@dataclass(frozen=True)
class _Forked:
    """Returned in the forked rank (never in the server): what to run."""

    job: RankJob


def _serve(sock: socket.socket, launcher: int, startup: _Startup) -> _Forked | None:
    """Answer the launcher until it closes the socket (None); in a forked rank, its job."""
    try:
        sock.send(json.dumps({"ready": os.getpid()}).encode())
    except OSError:  # the launcher stopped while the server imported
        return None
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except ConnectionError:
            return None
        if not message:
            return None
        request = json.loads(message)
        why = refusal(request["argv"], request["env"], startup.env)
        threads = _threads()
        if why is None and threads > 1:
            why = f"the fork server runs {threads} threads and a fork keeps only one"
        if why is None and accelerator_initialised():
            why = "the CUDA driver is initialised in the fork server (a fork could not use the device)"
        if why is not None or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"refused": why or "expected stdout and stderr descriptors"}).encode())
            continue
        job = RankJob.from_argv(request["argv"])
        if not isinstance(job, RankJob):  # checked by refusal()
            raise TypeError(job)
        why = None
        sys.stdout.flush()
        sys.stderr.flush()
        pid_r, pid_w = os.pipe()
        try:
            intermediate = os.fork()
        except OSError as e:
            intermediate = -1
            os.close(pid_w)
            why = f"fork: {e.strerror}"
        if intermediate == 0:
            rank = _fork_rank(pid_r, pid_w)  # returns only in the rank
            sock.close()
            _become_rank(request, fds, launcher=launcher, gate=rank, startup=startup)
            return _Forked(job)
        if intermediate > 0:
            os.close(pid_w)
        for fd in fds:
            os.close(fd)
        pid = int(os.read(pid_r, 32) or b"0") if intermediate > 0 else 0
        os.close(pid_r)
        if intermediate > 0:
            os.waitpid(intermediate, 0)
        sock.send(json.dumps({"pid": pid} if pid else {"refused": why or "the fork failed"}).encode())


def _fork_rank(pid_r: int, pid_w: int) -> int:
    """In the intermediate: fork the rank, tell the server its pid, exit (the rank is re-parented to the
    launcher). Returns only in the rank: the read end of a pipe that reaches EOF once the intermediate exited."""
    try:
        os.close(pid_r)
        gate_r, gate_w = os.pipe()
        rank = os.fork()
        if rank == 0:
            os.close(pid_w)
            os.close(gate_w)
            return gate_r
        os.write(pid_w, str(rank).encode())
    except BaseException:  # noqa: BLE001 - the intermediate never returns into the server's loop
        os._exit(71)
    os._exit(0)


def _become_rank(request: Mapping, fds: Sequence[int], *, launcher: int, gate: int, startup: _Startup) -> None:
    """In the forked rank: own session, re-parented to the launcher, the rank's streams and environment."""
    os.setsid()
    os.read(gate, 1)  # EOF: the intermediate exited
    os.close(gate)
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != launcher:  # the kernel re-parents us right after the intermediate's exit
        if time.monotonic() > deadline:
            os._exit(70)  # the launcher is gone, or is no subreaper
        time.sleep(0.0005)
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # died between the check and the prctl
        os._exit(70)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A fresh interpreter seeds these from the OS: each rank its own stream, not the server's.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
        if startup.openmp_pinned:
            torch.set_num_threads(_openmp_threads_of_a_fresh_process())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run(job: RankJob) -> int:
    """Run the job as ``python -u`` would; its exceptions and ``SystemExit`` end the process as there."""
    if job.module is not None:
        sys.argv = [job.module, *job.args]
        sys.path[0] = os.getcwd()
        runpy.run_module(job.module, run_name="__main__", alter_sys=True)
    else:
        script = str(job.script)
        sys.argv = [script, *job.args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or not argv[0].isdigit():
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    launcher = os.getppid()
    sock = socket.socket(fileno=int(argv[0]))
    startup = _pin_openmp()
    _preload()
    forked = _serve(sock, launcher, startup)
    if forked is None:
        # The launcher is done with the server, which ran no user code: skip the interpreter's teardown of
        # torch (0.7 s here), which the launcher's exit would otherwise wait for.
        os._exit(0)
    return _run(forked.job)


if __name__ == "__main__":
    sys.exit(main())
