"""torchrun's command line as torchrun parses it: option prefixes, ``--rdzv-conf`` meanings and
forms, ``--nproc-per-node`` words. Each test failed on the code before issue 24."""

from __future__ import annotations

import os

import pytest

from hyperpodrun import cli
from hyperpodrun.cli_abbrev import expand_abbreviations
from hyperpodrun.config import RendezvousSettings, parse_rdzv_conf, split_rdzv_conf, unused_rdzv_conf
from hyperpodrun.devices import ranks_for
from hyperpodrun.errors import ConfigError
from hyperpodrun.store import backend_spec


def _expand(*args: str) -> list[str]:
    import typer

    return expand_abbreviations(typer.main.get_command(cli.app), list(args))


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        (("--nproc-per=2", "t.py"), ["--nproc-per-node=2", "t.py"]),
        (("--nproc_per", "2", "t.py"), ["--nproc_per_node", "2", "t.py"]),
        (("--redirect", "3", "--tee=3", "t.py"), ["--redirects", "3", "--tee=3", "t.py"]),
        (("--stand", "--max-rest", "1", "t.py"), ["--standalone", "--max-restarts", "1", "t.py"]),
        (("-r3", "--no-py", "t.sh", "--redirect", "--nproc"), ["-r3", "--no-python", "t.sh", "--redirect", "--nproc"]),
        (("--rdzv-conf", "--not-an-option", "t.py"), ["--rdzv-conf", "--not-an-option", "t.py"]),
        (("--", "--redirect"), ["--", "--redirect"]),
    ],
)
def test_long_options_take_unique_prefixes_up_to_the_script(given: tuple[str, ...], meant: list[str]) -> None:
    assert _expand(*given) == meant


def test_an_ambiguous_prefix_names_the_candidates() -> None:
    with pytest.raises(ConfigError, match=r"ambiguous option: --max could match --max-backoff, --max-restarts"):
        _expand("--max", "1", "t.py")


def test_rdzv_conf_in_quotes_is_read_as_without_them() -> None:
    """torchrun's own tests pass --rdzv-conf='join_timeout=5,last_call_timeout=1' with the quotes kept."""
    assert parse_rdzv_conf("'join_timeout=5,last_call_timeout=1,timeout=5'") == {
        "join_timeout": "5",
        "last_call_timeout": "1",
        "timeout": "5",
    }
    assert parse_rdzv_conf('"a=1"') == {"a": "1"}


def test_rdzv_conf_keys_have_torchruns_meanings_and_defaults() -> None:
    c10d, etcd = backend_spec("c10d"), backend_spec("etcd")
    assert RendezvousSettings() == RendezvousSettings(join_timeout=600.0, last_call_timeout=30.0)
    settings, _ = split_rdzv_conf({"last_call_timeout": "1", "timeout": "5"}, c10d)
    assert (settings.last_call_timeout, settings.join_timeout) == (1.0, 600.0)  # c10d ignores timeout, as torchrun's
    settings, _ = split_rdzv_conf({"timeout": "5"}, etcd)
    assert settings.join_timeout == 5.0  # torchrun's etcd rendezvous timeout
    settings, _ = split_rdzv_conf({"timeout": "5", "join_timeout": "7"}, etcd)
    assert settings.join_timeout == 7.0


def test_unknown_rdzv_conf_keys_are_ignored_with_a_warning_but_typos_of_known_keys_are_errors() -> None:
    c10d = backend_spec("c10d")
    conf = {"my_plugin_option": "1", "close_timeout": "30", "join_timeout": "5"}
    settings, store = split_rdzv_conf(conf, c10d)
    assert settings.join_timeout == 5.0 and store == {}
    assert unused_rdzv_conf(conf, c10d) == ["my_plugin_option"]  # torchrun's close_timeout: known, no meaning here
    with pytest.raises(ConfigError, match="unknown key 'last_cal_timeout'"):
        split_rdzv_conf({"last_cal_timeout": "1"}, c10d)


def test_cpu_ranks_count_the_cpus_this_process_may_use(monkeypatch) -> None:
    """Under taskset -c 0 torchrun starts 1 rank; os.cpu_count() said 2."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert ranks_for("cpu") == 1
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert ranks_for("auto") == 1


def test_auto_counts_the_devices_of_torchs_current_accelerator(monkeypatch) -> None:
    """An XPU, MPS or PrivateUse1 accelerator counts, not only CUDA."""
    import torch

    class Xpu:
        type = "xpu"

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 3)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: Xpu())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ranks_for("auto") == 3
