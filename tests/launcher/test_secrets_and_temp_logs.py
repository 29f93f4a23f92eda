"""What a launch leaves behind: no credentials in the ranks, no temp log folder after success."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run


def test_ranks_get_no_store_credentials_and_success_leaves_no_temp_logs(tmp_path: Path) -> None:
    out, tmpdir = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmpdir.mkdir()
    env = clean_env(
        TMPDIR=str(tmpdir),
        HYPERPODRUN_STORE_SECRET="s" * 32,
        ETCDCTL_PASSWORD="p",
        PET_RDZV_CONF="join_timeout=60,secret_file=/nonexistent",  # the agent ignores PET_ for --standalone
        UNRELATED="kept",
    )
    proc = run(
        hyperpodrun_cmd("--standalone", "--nproc-per-node", "1", str(SCRIPTS / "dump_env.py"), str(out)), env=env
    )
    assert proc.returncode == 0, proc.stderr
    rank_env = json.loads((out / "env_0.json").read_text())
    assert "HYPERPODRUN_STORE_SECRET" not in rank_env and "ETCDCTL_PASSWORD" not in rank_env
    assert rank_env["UNRELATED"] == "kept"
    assert not list(tmpdir.glob("hyperpodrun_*")), "a successful job left its temporary log folder"


def test_a_failed_job_keeps_the_temp_logs_it_names(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = clean_env(TMPDIR=str(tmpdir), FAIL_RANK="0")
    proc = run(hyperpodrun_cmd("--nproc-per-node", "1", str(SCRIPTS / "fail.py"), "exit:3"), env=env)
    assert proc.returncode == 1, proc.stderr
    [kept] = tmpdir.glob("hyperpodrun_*")
    log_file = proc.stderr.strip().splitlines()[-1].rsplit("log: ", 1)[-1]
    assert log_file.startswith(str(kept)) and Path(log_file).is_file(), proc.stderr
