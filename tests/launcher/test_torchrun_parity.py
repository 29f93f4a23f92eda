"""Drop-in parity: the behaviours PyTorch's own launcher tests check, run against torchrun and
hyperpodrun in the same session (each test is parametrised over both), so a difference fails.

What PyTorch's ``test/distributed/launcher/test_run.py`` checks and this file covers: every rank
runs (a Python script, ``-m``, ``--run-path``, a bash script with ``--no-python``), the launcher's
variables reach the ranks (and the parent's environment does), ``PET_*`` variables stand for
flags, the ``--nproc-per-node`` forms, ``--standalone``, an elastic ``1:2`` job started alone
(``--rdzv-conf`` in quotes, ``last_call_timeout``), two agents of one elastic job, console
capture with ``--redirect``/``--tee`` and ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, abbreviated
options, and a worker exception's exit code. Deliberate differences (docs/torchrun_flags.md,
"Deliberate differences") are asserted per launcher where a test meets one.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support.launch import clean_env, hyperpodrun_cmd, torchrun_cmd
from support.ports import free_port

PARITY = Path(__file__).resolve().parent / "parity"
SCRIPT, BASH = PARITY / "touch_rank.py", PARITY / "touch_rank.sh"
LAUNCHERS: dict[str, Callable[..., list[str]]] = {"torchrun": torchrun_cmd, "hyperpodrun": hyperpodrun_cmd}

pytestmark = pytest.mark.parametrize("launcher", list(LAUNCHERS))


def _launch(launcher: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout=90):
    return subprocess.run(
        LAUNCHERS[launcher](*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(TEST_SENTINEL_PARENT="FOOBAR", **(env or {})),
        cwd=cwd,
    )


def _ranks(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_rank_runs_with_the_launchers_variables_and_its_console_captured(launcher: str, tmp_path: Path) -> None:
    """Abbreviated options (--nproc-per, --redirect), --tee, the prefix template, the ranks' variables."""
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}
    (tmp_path / "out").mkdir()
    args = ("--nnodes=1", "--nproc-per=3", "--rdzv-id=parity", "--redirect=3", "--tee=3", "--log-dir", str(tmp_path))
    proc = _launch(launcher, *args, str(SCRIPT), str(tmp_path / "out"), "x", env=env)
    _ok(proc)
    assert _ranks(tmp_path / "out") == {"0", "1", "2"}
    for rank in (0, 1, 2):
        assert f"[rank{rank}]: creating {tmp_path / 'out' / str(rank)}" in proc.stdout.splitlines(), proc.stdout
    seen = json.loads((tmp_path / "out" / "1").read_text())
    env = seen["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "3", "3")
    assert (env["GROUP_RANK"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("0", "1", "3")
    assert env["ROLE_NAME"] == "default"
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
    assert env["TORCHELASTIC_ERROR_FILE"] and env["MASTER_ADDR"] and env["MASTER_PORT"]
    assert env["TEST_SENTINEL_PARENT"] == "FOOBAR"  # the parent's environment reaches the ranks
    assert seen["main"] == "__main__" and seen["argv"] == ["x"]
    # a listed difference: one node without --master-port, torchrun replaces --rdzv-id with a fresh uuid
    assert (env["TORCHELASTIC_RUN_ID"] == "parity") == (launcher == "hyperpodrun")


@pytest.mark.parametrize(
    "how", [("-m", "touch_rank"), ("--run-path", "--standalone", str(SCRIPT))], ids=["m", "run-path"]
)
def test_a_module_and_a_run_path_run_as_main(launcher: str, how: tuple[str, ...], tmp_path: Path) -> None:
    _ok(_launch(launcher, "--nnodes=1", "--nproc-per-node=2", *how, str(tmp_path), cwd=PARITY))
    assert _ranks(tmp_path) == {"0", "1"}
    assert json.loads((tmp_path / "0").read_text())["main"] == "__main__"


def test_pet_variables_a_bash_script_and_auto_from_the_usable_cpus(launcher: str, tmp_path: Path) -> None:
    """PET_* stand for flags; auto counts the CPUs the process may use (taskset -c 0: one rank, not one per CPU
    of the machine); a listed difference: torchrun prefixes only what it tees, hyperpodrun every console line."""
    env = clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="auto", PET_NO_PYTHON="1", PET_MODULE="0")
    cmd = ["taskset", "-c", "0", *LAUNCHERS[launcher](str(BASH), str(tmp_path))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    _ok(proc)
    assert _ranks(tmp_path) == {"0"}
    line = f"creating {tmp_path / '0'}"
    assert (line if launcher == "torchrun" else f"[rank0]:{line}") in proc.stdout.splitlines(), proc.stdout
    listed = (Path(__file__).resolve().parents[2] / "docs" / "torchrun_flags.md").read_text()
    differences = listed.split("## Deliberate differences", 1)[-1]
    assert "console prefix" in differences and "--rdzv-id" in differences


def test_module_with_no_python_is_refused(launcher: str, tmp_path: Path) -> None:
    refused = _launch(launcher, "--nproc-per-node=2", "--no-python", "--module", str(BASH), str(tmp_path))
    assert refused.returncode != 0  # torchrun: ValueError (exit 1, a traceback); hyperpodrun: one line, exit 2
    assert not any(tmp_path.iterdir())


def _elastic(port: int, *extra: str) -> tuple[str, ...]:
    return ("--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", *extra)


def test_a_lone_node_of_an_elastic_job_starts_after_the_last_call(launcher: str, tmp_path: Path) -> None:
    """torchrun's own test passes the --rdzv-conf value with its quotes; last_call_timeout=1 starts it at once."""
    conf = "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"
    start = time.monotonic()
    _ok(_launch(launcher, *_elastic(free_port(), conf, "--rdzv-id=lone"), str(SCRIPT), str(tmp_path), timeout=40))
    assert time.monotonic() - start < 25
    assert _ranks(tmp_path) == {"0", "1"}


def test_two_agents_of_one_elastic_job_form_one_world(launcher: str, tmp_path: Path) -> None:
    args = LAUNCHERS[launcher](*_elastic(free_port(), "--rdzv_conf=timeout=5", "--rdzv-id=pair"), str(SCRIPT))
    env = clean_env(TEST_SENTINEL_PARENT="FOOBAR")
    agents = [subprocess.Popen([*args, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        codes = [agent.wait(timeout=90) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert codes == [0, 0], [agent.stderr.read()[-2000:] for agent in agents]
    assert _ranks(tmp_path) == {"0", "1", "2", "3"}
    assert {json.loads((tmp_path / r).read_text())["env"]["WORLD_SIZE"] for r in "0123"} == {"4"}


def test_a_worker_exception_fails_the_launch_with_exit_code_1(launcher: str, tmp_path: Path) -> None:
    conf = "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"
    start = time.monotonic()
    proc = _launch(launcher, *_elastic(free_port(), conf, "--max-restarts=0"), str(SCRIPT), str(tmp_path), "--fail")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - start < 25  # reported as a worker failure, not after a rendezvous timeout
    assert "raising exception since --fail flag was set" in proc.stderr
    assert not any(tmp_path.iterdir())
