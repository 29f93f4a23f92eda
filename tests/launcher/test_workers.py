"""Running ranks: collectives, script arguments, flags from PET_* and both spellings, logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run, torchrun_cmd


def test_two_rank_allreduce() -> None:
    proc = run(hyperpodrun_cmd("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "allreduce.py")))
    assert proc.returncode == 0, proc.stderr
    lines = sorted(re.findall(r"^\[rank(\d)\]:rank=(\d) world=2 sum=3$", proc.stdout, re.M))
    assert lines == [("0", "0"), ("1", "1")], proc.stdout


def test_options_after_the_script_belong_to_the_script() -> None:
    proc = run(hyperpodrun_cmd(str(SCRIPTS / "echo_args.py"), "--nproc-per-node", "7", "-m", "x", "--", "y"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.split("ARGS ", 1)[1].splitlines()[0]) == [
        "--nproc-per-node",
        "7",
        "-m",
        "x",
        "--",
        "y",
    ]


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--nproc_per_node", "2"], {}),  # underscore spelling
        (["--nproc-per-node=2"], {}),  # = form
        ([], {"PET_NPROC_PER_NODE": "2"}),  # torchrun's environment default
        (["--nproc-per-node", "2"], {"PET_NPROC_PER_NODE": "3"}),  # the flag wins over the environment
    ],
)
def test_flag_spellings_and_pet_defaults(flags: list[str], env: dict[str, str]) -> None:
    proc = run(hyperpodrun_cmd(*flags, str(SCRIPTS / "allreduce.py")), env=clean_env(**env))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("world=2 sum=3") == 2


def test_module_mode_runs_a_module() -> None:
    proc = run(
        hyperpodrun_cmd("--nproc-per-node", "2", "-m", "allreduce"),
        env=clean_env(PYTHONPATH=str(SCRIPTS)),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("world=2 sum=3") == 2


def test_unmodified_torchrun_script_runs_unchanged(tmp_path: Path) -> None:
    script = str(SCRIPTS / "torchrun_ddp_example.py")
    flags = ["--standalone", "--nproc-per-node", "2"]
    ours = run(hyperpodrun_cmd(*flags, script, "--steps", "4"))
    # torchrun writes both ranks to one unprefixed stdout, where lines can interleave: read its per-rank files
    theirs = run(torchrun_cmd(*flags, "--log-dir", str(tmp_path), "--redirects", "1", script, "--steps", "4"))
    assert ours.returncode == theirs.returncode == 0, ours.stderr
    pattern = r"Finished running basic DDP example on rank (\d): checksum=(\S+)"
    theirs_out = "".join(p.read_text() for p in tmp_path.rglob("stdout.log"))
    ours_sums = sorted(re.findall(pattern, ours.stdout))
    assert ours_sums == sorted(re.findall(pattern, theirs_out)) and len(ours_sums) == 2
    assert ours_sums[0][1] == ours_sums[1][1]  # DDP kept the replicas identical


def test_logs_redirect_tee_and_filter(tmp_path: Path) -> None:
    proc = run(
        hyperpodrun_cmd(
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path),
            "--rdzv-id",
            "job1",
            "--redirects",
            "1",
            "--tee",
            "0:2",
            "--local-ranks-filter",
            "0",
            str(SCRIPTS / "echo_args.py"),
            "a",
        )
    )
    assert proc.returncode == 0, proc.stderr
    attempt = tmp_path / "job1" / "attempt_0"
    for r in (0, 1):
        assert (attempt / str(r) / "stdout.log").read_text().startswith('ARGS ["a"]')
        assert (attempt / str(r) / "stderr.log").read_text() == f"stderr-line rank {r}\n"
    assert "ARGS" not in proc.stdout  # stdout redirected to files only
    assert "[rank0]:stderr-line rank 0" in proc.stderr  # tee'd stderr of rank 0 on the console
    assert "stderr-line rank 1" not in proc.stderr  # filtered out of the console
