"""The fork server (``--start-method forkserver``): ranks forked from one interpreter that imported torch.

The server and its forks are real processes; the test process plays the launcher (a child subreaper,
so the forked ranks are re-parented to it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_events.rounds.forkserver import CUDA_ERROR_NOT_INITIALIZED, RankJob, accelerator_initialised, refusal
from hyperpodrun.forkserver import ForkedProcess, ForkServer
from hyperpodrun.supervisor import become_subreaper, child_setup, restore_subreaper
from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run

PY = sys.executable

PROBE = """\
import json, os, sys, random
import torch
code = int(os.environ.get("PROBE_EXIT", "0"))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                  "torch_rand": torch.rand(2).tolist(), "random": random.random(), "name": __name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ.get("PROBE_RAISE"):
    raise RuntimeError("probe failed on purpose")
open(os.environ["PROBE_FILE"], "w").write("unflushed until exit") if os.environ.get("PROBE_FILE") else None
sys.exit(code)
"""


@contextlib.contextmanager
def _own_server(env: dict[str, str], preexec_fn: Callable[[], None] | None = child_setup) -> Iterator[ForkServer]:
    """A fork server of this test process, made a child subreaper for as long as the server runs."""
    was = become_subreaper()
    fs = ForkServer(python=PY, env=env, preexec_fn=preexec_fn)
    try:
        yield fs
    finally:
        fs.close()
        restore_subreaper(was)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    with _own_server(clean_env()) as fs:
        yield fs


def _fork(server: ForkServer, tmp_path: Path, *args: str, **env: str) -> tuple[ForkedProcess, Path, Path]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out, err = (
        tmp_path / f"out{len(list(tmp_path.iterdir()))}.log",
        tmp_path / f"err{len(list(tmp_path.iterdir()))}.log",
    )
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o644) for p in (out, err)]
    try:
        proc = server.spawn(
            [PY, "-u", str(script), *args], env=clean_env(**env), stdout=fds[0], stderr=fds[1], cwd=str(tmp_path)
        )
    finally:
        for fd in fds:
            os.close(fd)
    assert proc is not None
    return proc, out, err


def test_a_forked_rank_runs_the_script_as_python_would(server: ForkServer, tmp_path: Path) -> None:
    proc, out, err = _fork(server, tmp_path, "a", "--b", RANK="3")
    assert proc.wait(timeout=30) == 0
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(tmp_path / "probe.py"), "a", "--b"]
    assert seen["path0"] == str(tmp_path) and seen["cwd"] == str(tmp_path) and seen["name"] == "__main__"
    assert seen["rank"] == "3"
    assert seen["pid"] == proc.pid and seen["ppid"] == os.getpid()  # re-parented to the launcher
    assert seen["pgid"] == seen["sid"] == proc.pid  # its own session, as start_new_session
    assert err.read_text() == "to stderr\n"


def test_each_forked_rank_draws_its_own_random_numbers(server: ForkServer, tmp_path: Path) -> None:
    seen = []
    for _ in range(2):
        proc, out, _ = _fork(server, tmp_path)
        assert proc.wait(timeout=30) == 0
        seen.append(json.loads(out.read_text()))
    assert seen[0]["torch_rand"] != seen[1]["torch_rand"]
    assert seen[0]["random"] != seen[1]["random"]


@pytest.mark.parametrize(
    ("env", "code"),
    [({"PROBE_EXIT": "3"}, 3), ({"PROBE_RAISE": "1"}, 1), ({}, 0)],
    ids=["sys.exit(3)", "exception", "success"],
)
def test_a_forked_rank_exits_with_the_scripts_status(server: ForkServer, tmp_path: Path, env: dict, code: int) -> None:
    proc, _, err = _fork(server, tmp_path, **env, PROBE_FILE=str(tmp_path / "written"))
    assert proc.wait(timeout=30) == code
    if code == 1:
        assert "RuntimeError: probe failed on purpose" in err.read_text()
    else:
        assert (tmp_path / "written").read_text() == "unflushed until exit"  # the interpreter's exit flushed it


def test_a_killed_forked_rank_reports_the_signal(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    out = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o644)
    proc = server.spawn([PY, "-u", str(script)], env=clean_env(), stdout=out, stderr=out)
    os.close(out)
    assert proc is not None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_a_command_a_fork_cannot_run_is_refused_and_said_once(
    server: ForkServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for _ in range(2):
            env = clean_env(PYTHONPATH="/somewhere/else")
            assert server.spawn([PY, "-u", str(tmp_path / "x.py")], env=env, stdout=out, stderr=out) is None
        assert server.spawn([PY, "-O", str(tmp_path / "x.py")], env=clean_env(), stdout=out, stderr=out) is None
    finally:
        os.close(out)
    said = capsys.readouterr().err
    assert said.count("PYTHONPATH differs") == 1 and "not run as python -u ('-O" in said
    assert server.broken is None  # the server still forks other commands


THREADS = """\
import json, os, torch
a = torch.randn(256, 256)
print(json.dumps({"threads": torch.get_num_threads(), "product_ok": bool(torch.allclose((a @ a.T), (a @ a.T).T)),
                  "omp_env": os.environ.get("OMP_NUM_THREADS")}), flush=True)
"""


def test_a_job_that_sets_no_thread_count_is_forked_with_a_fresh_processs_count(tmp_path: Path) -> None:
    """One rank per node and no ``OMP_NUM_THREADS``: the server imports torch with OpenMP at one thread (so it
    stays forkable), and each rank gets the thread count a fresh interpreter picks, not the server's one."""
    env = {k: v for k, v in clean_env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    fresh = subprocess.run([PY, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True)
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    with _own_server(env) as fs:
        fd = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            proc = fs.spawn([PY, "-u", str(script)], env=env, stdout=fd, stderr=fd, cwd=str(tmp_path))
        finally:
            os.close(fd)
        assert proc is not None, "refused: the server was not forkable"
        assert proc.wait(timeout=60) == 0, (tmp_path / "out.log").read_text()
    seen = json.loads((tmp_path / "out.log").read_text())
    assert seen == {"threads": int(fresh.stdout), "product_ok": True, "omp_env": None}, (seen, fresh.stdout)


def test_a_start_that_must_not_wait_is_not_forked_while_the_server_imports(tmp_path: Path) -> None:
    """A standby's parked ranks and a spare must not hold the launcher's loop for the server's imports (seconds):
    until the server is ready they start as fresh processes (None here), without breaking it; after, forked."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    with _own_server(clean_env()) as fs:
        fd = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            t0 = time.monotonic()
            early = fs.spawn([PY, "-u", str(script)], env=clean_env(), stdout=fd, stderr=fd, wait_ready=False)
            waited = time.monotonic() - t0
            forked = fs.spawn([PY, "-u", str(script)], env=clean_env(), stdout=fd, stderr=fd)  # waits for it
            later = fs.spawn([PY, "-u", str(script)], env=clean_env(), stdout=fd, stderr=fd, wait_ready=False)
        finally:
            os.close(fd)
        assert early is None and waited < 0.5, waited  # the server was still importing torch
        assert fs.broken is None
        assert forked is not None and later is not None  # ready: forked with or without waiting
        assert forked.wait(timeout=60) == 0 and later.wait(timeout=60) == 0


def test_a_dead_server_falls_back_to_fresh_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _own_server(clean_env(), preexec_fn=None) as fs:
        os.kill(fs.pid, signal.SIGKILL)
        out = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o644)
        assert fs.spawn([PY, "-u", str(tmp_path / "x.py")], env=clean_env(), stdout=out, stderr=out) is None
        os.close(out)
        assert fs.broken is not None and "exited" in fs.broken
        assert "ranks start as fresh processes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([PY, "-u", "train.py", "--lr", "1"], RankJob(script="train.py", module=None, args=("--lr", "1"))),
        ([PY, "-u", "-m", "pkg.train", "x"], RankJob(script=None, module="pkg.train", args=("x",))),
        ([PY, "train.py"], "not run as python -u ('train.py')"),
        ([PY, "-u", "-X", "importtime"], "interpreter option '-X'"),
        (["/usr/bin/other-python", "-u", "t.py"], "not this interpreter"),
    ],
)
def test_rank_job_reads_the_workers_command(argv: list[str], expected: RankJob | str) -> None:
    job = RankJob.from_argv(argv)
    assert job == expected if isinstance(expected, RankJob) else str(job).startswith(expected)


LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
MAPS_WITH_DRIVER = [
    "7f00-7f10 r--p 00000000 08:01 12 /usr/lib/libc.so.6\n",
    f"7f20-7f30 r-xp 00000000 08:01 13 {LIBCUDA}\n",
]


class FakeDriver:
    """libcuda as ctypes would load it: ``cuDeviceGetCount`` answers ``answer``; records the path it was loaded from."""

    def __init__(self, answer: int) -> None:
        self.answer, self.paths = answer, []

    def __call__(self, path: str) -> FakeDriver:
        self.paths.append(path)
        return self

    def cuDeviceGetCount(self, count: object) -> int:  # noqa: N802 - the driver's name
        return self.answer


@pytest.mark.parametrize(
    ("answer", "initialised"),
    [(CUDA_ERROR_NOT_INITIALIZED, False), (0, True), (100, True)],  # 100: CUDA_ERROR_NO_DEVICE, after cuInit
    ids=["loaded-not-initialised", "initialised", "initialised-no-device"],
)
def test_a_loaded_driver_stops_forks_only_once_initialised(answer: int, initialised: bool) -> None:
    """The server's imports can map libcuda without cuInit: the server may still fork then, not after cuInit."""
    driver = FakeDriver(answer)
    assert accelerator_initialised(lambda: MAPS_WITH_DRIVER, driver) is initialised
    assert driver.paths == [LIBCUDA]  # the mapped library itself, not whichever the loader finds by name


def test_no_driver_mapped_lets_the_server_fork_and_an_unaskable_one_stops_it() -> None:
    never = FakeDriver(0)
    assert accelerator_initialised(lambda: MAPS_WITH_DRIVER[:1], never) is False
    assert never.paths == []

    def unloadable(path: str) -> FakeDriver:
        raise OSError(f"{path}: cannot open shared object file")

    assert accelerator_initialised(lambda: MAPS_WITH_DRIVER, unloadable) is True
    assert accelerator_initialised() is False  # this CPU machine's own process: no driver mapped


def test_refusal_compares_the_variables_read_at_interpreter_start() -> None:
    argv = [PY, "-u", "t.py"]
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert refusal(argv, {**base, "RANK": "1", "MASTER_PORT": "5"}, base) is None  # rank variables are read later
    assert "OMP_NUM_THREADS differs" in str(refusal(argv, {**base, "OMP_NUM_THREADS": "4"}, base))
    assert "LD_PRELOAD differs" in str(refusal(argv, {**base, "LD_PRELOAD": "x.so"}, base))


def test_a_forkserver_job_forks_its_ranks_from_the_server() -> None:
    cmd = hyperpodrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--start-method", "forkserver", str(SCRIPTS / "allreduce.py")
    )
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"^\[rank(\d)\]:rank=(\d) world=2 sum=3$", proc.stdout, re.M)) == [("0", "0"), ("1", "1")]
    assert "fork server" not in proc.stderr  # nothing was refused, nothing fell back
