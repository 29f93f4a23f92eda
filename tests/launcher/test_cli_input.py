"""Bad input: one clear line on stderr, a non-zero exit, nothing started, never a traceback."""

from __future__ import annotations

import pytest

from hyperpodrun.config import Std, parse_nnodes, parse_rdzv_conf, parse_std
from hyperpodrun.errors import ConfigError
from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run

GOOD = str(SCRIPTS / "allreduce.py")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bogus-flag", GOOD], "No such option: --bogus-flag"),
        (["--nnodes", "3:2", GOOD], "--nnodes: MIN must not exceed MAX"),
        (["--nnodes", "a:b", GOOD], "--nnodes: expected N or MIN:MAX"),
        (["--nproc-per-node", "0", GOOD], "--nproc-per-node: must be >= 1"),
        (["--nproc-per-node", "many", GOOD], "--nproc-per-node: expected a positive integer"),
        (["does_not_exist.py"], "training script 'does_not_exist.py' not found"),
        (["--rdzv-conf", "timeout", GOOD], "--rdzv-conf: expected key=value"),
        (["--rdzv-backend", "zookeeper", GOOD], "--rdzv-backend: unknown backend 'zookeeper'"),
        (["--rdzv-backend", "etcd-v2", GOOD], "etcd v2 API is not supported"),
        (["--redirects", "7", GOOD], "--redirects: expected 0, 1, 2 or 3"),
        (["--max-restarts", "-1", GOOD], "--max-restarts: must be >= 0"),
        (["--spare-ranks", "2", GOOD], "--spare-ranks: must be 0 or 1"),
        (["--signals-to-handle", "SIGNOPE", GOOD], "unknown signal 'SIGNOPE'"),
        (["--standalone", "--nnodes", "2", GOOD], "--standalone runs one node"),
        (["--metrics-port", "70000", GOOD], "--metrics-port: must be in 0..65535"),
        ([], "Missing argument"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args: list[str], expected: str) -> None:
    proc = run(hyperpodrun_cmd(*args), timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hyperpodrun: error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_version() -> None:
    from hyperpodrun import __version__

    proc = run(hyperpodrun_cmd("--version"), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"hyperpodrun {__version__}"


def test_help_lists_every_torchrun_flag() -> None:
    proc = run(hyperpodrun_cmd("--help"), timeout=60, env=clean_env(COLUMNS="200", TERM="dumb"))
    assert proc.returncode == 0
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv-conf",
        "--standalone",
        "--max-restarts",
        "--monitor-interval",
        "--start-method",
        "--role",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--local-addr",
        "--redirects",
        "--tee",
        "--log-dir",
        "--local-ranks-filter",
        "--module",
        "--no-python",
        "--run-path",
        "--signals-to-handle",
    ):
        assert flag in proc.stdout, flag


@pytest.mark.parametrize(("text", "expected"), [("2", (2, 2)), ("1:4", (1, 4)), (" 3:3 ", (3, 3))])
def test_parse_nnodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


def test_parse_rdzv_conf_and_std() -> None:
    assert parse_rdzv_conf("timeout=30, cacert=/a/b.pem") == {"timeout": "30", "cacert": "/a/b.pem"}
    assert parse_rdzv_conf("") == {}
    assert parse_std("0:3,1:1", flag="--tee", nproc=3) == {0: Std.ALL, 1: Std.OUT, 2: Std.NONE}
    with pytest.raises(ConfigError, match="local rank 5 out of range"):
        parse_std("5:1", flag="--tee", nproc=2)


@pytest.mark.parametrize("argv", [[], ["ctl", "x", "--script", "t.py"], ["ctl", "0", "--exec", "t.py"]])
def test_the_spare_entry_point_refuses_malformed_arguments_before_importing_torch(argv, capsys) -> None:
    from elastic_events.rounds.spare import USAGE, main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"usage: {USAGE}"
