"""Suspicious but legal input gets a warning line and the job still starts; folders that dead
agents left in /dev/shm are removed at start. Each failed on the code before issue 24."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpodrun import cli
from hyperpodrun.agent_dir import LOCK, AgentDir
from support.launch import SCRIPTS


@pytest.fixture
def launched(monkeypatch) -> list:
    """cli.main up to the launch (the warnings come first); the configs it would launch."""
    import hyperpodrun.launch

    configs: list = []
    monkeypatch.setattr(hyperpodrun.launch, "launch", configs.append)
    for name in [k for k in os.environ if k.startswith(("PET_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    return configs


def test_more_ranks_than_usable_cpus_is_a_warning(launched, capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cli.main(["--nproc-per-node", "12", str(SCRIPTS / "echo_args.py")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hyperpodrun: warning: --nproc-per-node 12: more ranks than the 2 CPU(s) this process may use; "
        "they will compete for cores"
    ]
    assert launched and launched[0].nproc_per_node == 12


def test_an_unknown_rdzv_conf_key_is_a_warning_as_torchrun_ignores_it(launched, capsys) -> None:
    argv = ["--rdzv-backend", "c10d", "--nnodes", "1:2", "--rdzv-conf", "my_option=1,join_timeout=5"]
    assert cli.main([*argv, str(SCRIPTS / "echo_args.py")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hyperpodrun: warning: --rdzv-conf my_option: not a setting of --rdzv-backend c10d; ignored"]
    assert launched[0].rdzv_settings.join_timeout == 5.0


def test_a_second_launcher_of_the_same_job_on_this_host_is_noted(tmp_path) -> None:
    first, _ = AgentDir.create(job="job-7", root=str(tmp_path))
    try:
        second, swept = AgentDir.create(job="job-7", root=str(tmp_path))
        other, swept_other = AgentDir.create(job="job-8", root=str(tmp_path))
        second.close()
        other.close()
    finally:
        first.close()
    assert os.getpid() in swept.same_job  # both launchers give their ranks LOCAL_RANK 0 upward
    assert swept_other.same_job == ()
    assert not any(tmp_path.iterdir())


def test_folders_of_dead_agents_are_removed_at_start_and_others_are_left_alone(tmp_path: Path) -> None:
    dead = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from hyperpodrun.agent_dir import AgentDir\n"
            f"d, _ = AgentDir.create(job='j', root={str(tmp_path)!r}); (d.path / 'handoff.bin').write_bytes(b'x' * 4096)\n"
            "print(d.path); os._exit(0)  # killed: nothing cleaned up",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    left = Path(dead.stdout.strip())
    assert (left / LOCK).exists()
    secrets = tmp_path / f"hyperpodrun-{os.getuid()}"  # the per-user secret folder: no lock, never touched
    secrets.mkdir()
    unrelated = tmp_path / "hyperpodrun-etcd-data"
    unrelated.mkdir()
    alive, swept = AgentDir.create(job="k", root=str(tmp_path))
    try:
        assert swept.removed == (left,) and not left.exists()
        mine, again = AgentDir.create(job="k", root=str(tmp_path))
        mine.close()
        assert again.removed == () and alive.path.exists()  # a live agent's folder stays
        assert secrets.exists() and unrelated.exists()
    finally:
        alive.close()
