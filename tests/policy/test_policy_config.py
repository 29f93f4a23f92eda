"""ElasticPolicy validation, allowed sizes, backoff, and building a policy from a file and flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hyperpodrun.errors import ConfigError
from hyperpodrun.policy import ElasticPolicy, PolicyError, ScaleEvent, required_stable_period
from hyperpodrun.policy_file import (
    PolicyFileError,
    build_policy,
    load_policy_file,
    parse_replica_values,
)

# --------------------------------------------------------------------------- ElasticPolicy


@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        (dict(min_replicas=1, max_replicas=4), (1, 2, 3, 4)),
        (dict(min_replicas=3, max_replicas=3), (3,)),
        (dict(min_replicas=2, max_replicas=8, replica_increment_step=2), (2, 4, 6, 8)),
        (dict(min_replicas=2, max_replicas=9, replica_increment_step=3), (2, 5, 8)),
        (dict(min_replicas=1, max_replicas=4, replica_increment_step=10), (1,)),
        (dict(min_replicas=1, max_replicas=16, replica_discrete_values=(2, 8, 16)), (2, 8, 16)),
        (dict(min_replicas=4, max_replicas=4, replica_discrete_values=(4,)), (4,)),
    ],
)
def test_allowed_sizes(kwargs: dict, sizes: tuple[int, ...]) -> None:
    assert ElasticPolicy(**kwargs).allowed_sizes() == sizes


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, None), (1, None), (2, 2), (3, 2), (7, 6), (8, 8), (100, 8)],
)
def test_largest_allowed_at_most(n: int, expected: int | None) -> None:
    policy = ElasticPolicy(min_replicas=2, max_replicas=8, replica_increment_step=2)
    assert policy.largest_allowed_at_most(n) == expected


def test_defaults_are_documented_values_and_floats() -> None:
    policy = ElasticPolicy(min_replicas=1, max_replicas=2, scaling_timeout=5)
    assert policy.scaling_timeout == 5.0 and isinstance(policy.scaling_timeout, float)
    assert (policy.graceful_shutdown_timeout, policy.faulty_scale_down_timeout) == (120.0, 30.0)
    assert (policy.min_stable_period, policy.backoff_window, policy.backoff_factor, policy.max_backoff) == (
        60.0,
        900.0,
        2.0,
        600.0,
    )


def test_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        ElasticPolicy(1, 2)  # type: ignore[misc]
    policy = ElasticPolicy(min_replicas=1, max_replicas=2)
    with pytest.raises(AttributeError):
        policy.min_replicas = 2  # type: ignore[misc]


_BASE = dict(min_replicas=2, max_replicas=8)


@pytest.mark.parametrize(
    ("overrides", "fields", "fragment"),
    [
        (dict(min_replicas=0), ("min_replicas",), "min_replicas must be >= 1, got 0"),
        (dict(min_replicas=True), ("min_replicas",), "min_replicas must be an integer"),
        (dict(max_replicas=2.0), ("max_replicas",), "max_replicas must be an integer"),
        (dict(max_replicas=1), ("max_replicas", "min_replicas"), "max_replicas (1) must be >= min_replicas (2)"),
        (
            dict(replica_increment_step=2, replica_discrete_values=(2, 4)),
            ("replica_increment_step", "replica_discrete_values"),
            "mutually exclusive",
        ),
        (dict(replica_increment_step=0), ("replica_increment_step",), "replica_increment_step must be >= 1"),
        (dict(replica_discrete_values=()), ("replica_discrete_values",), "non-empty tuple"),
        (dict(replica_discrete_values=[2, 4]), ("replica_discrete_values",), "non-empty tuple"),
        (dict(replica_discrete_values=(2, "4")), ("replica_discrete_values",), "only integers"),
        (
            dict(replica_discrete_values=(2, 9)),
            ("replica_discrete_values", "min_replicas", "max_replicas"),
            "9 is outside [min_replicas=2, max_replicas=8]",
        ),
        (
            dict(replica_discrete_values=(1, 2)),
            ("replica_discrete_values", "min_replicas", "max_replicas"),
            "1 is outside",
        ),
        (dict(replica_discrete_values=(4, 2)), ("replica_discrete_values",), "sorted ascending without duplicates"),
        (dict(replica_discrete_values=(2, 2)), ("replica_discrete_values",), "sorted ascending without duplicates"),
        (dict(graceful_shutdown_timeout=0), ("graceful_shutdown_timeout",), "graceful_shutdown_timeout must be > 0"),
        (dict(scaling_timeout=-1), ("scaling_timeout",), "scaling_timeout must be >= 0"),
        (dict(faulty_scale_down_timeout=math.nan), ("faulty_scale_down_timeout",), "must be a finite number"),
        (dict(scaling_timeout="60"), ("scaling_timeout",), "scaling_timeout must be a finite number, got '60'"),
        (dict(min_stable_period=math.inf), ("min_stable_period",), "min_stable_period must be a finite number"),
        (dict(backoff_factor=0.5), ("backoff_factor",), "backoff_factor must be >= 1"),
        (dict(min_stable_period=100, max_backoff=50), ("max_backoff", "min_stable_period"), "max_backoff (50)"),
        (dict(max_backoff=1000, backoff_window=900), ("max_backoff", "backoff_window"), "must be <= backoff_window"),
    ],
)
def test_validation_errors_name_fields(overrides: dict, fields: tuple[str, ...], fragment: str) -> None:
    with pytest.raises(PolicyError) as info:
        ElasticPolicy(**{**_BASE, **overrides})
    assert info.value.fields == fields
    assert fragment in str(info.value)
    assert fields[0] in str(info.value)


def test_policy_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        ElasticPolicy(min_replicas=0, max_replicas=1)
    assert isinstance(info.value, ValueError)
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("nproc", "max_world", "fitting"),
    [
        (4, None, (2, 4, 6, 8)),
        (4, 32, (2, 4, 6, 8)),
        (4, 31, (2, 4, 6)),
        (4, 8, (2,)),
        (1, 5, (2, 4)),
    ],
)
def test_validate_world_returns_fitting_sizes(nproc: int, max_world: int | None, fitting: tuple[int, ...]) -> None:
    policy = ElasticPolicy(min_replicas=2, max_replicas=8, replica_increment_step=2)
    assert policy.validate_world(nproc_per_node=nproc, max_world_size=max_world) == fitting


def test_validate_world_rejects_when_nothing_fits() -> None:
    policy = ElasticPolicy(min_replicas=2, max_replicas=8)
    with pytest.raises(PolicyError) as info:
        policy.validate_world(nproc_per_node=4, max_world_size=7)
    message = str(info.value)
    assert "max_world_size=7" in message and "2 x nproc_per_node 4 = 8 ranks" in message


# --------------------------------------------------------------------------- backoff


_BACKOFF = ElasticPolicy(
    min_replicas=1, max_replicas=2, min_stable_period=10, backoff_window=100, backoff_factor=2, max_backoff=70
)


@pytest.mark.parametrize(
    ("events", "now", "expected"),
    [
        ((), 0.0, 10.0),
        (((0.0, 2),), 5.0, 10.0),
        (((0.0, 2), (50.0, 3)), 60.0, 10.0),  # growth after start: base
        (((0.0, 1), (50.0, 2), (60.0, 3), (70.0, 4)), 80.0, 10.0),  # a growth streak: base
        (((0.0, 4), (50.0, 3), (60.0, 2)), 70.0, 10.0),  # a shrink streak: base
        (((0.0, 2), (50.0, 3), (60.0, 2)), 70.0, 20.0),  # down after up
        (((0.0, 2), (50.0, 3), (60.0, 2), (70.0, 3)), 80.0, 40.0),  # up after down after up
        (((0.0, 2), (50.0, 3), (60.0, 2), (70.0, 3), (80.0, 2)), 90.0, 70.0),  # 80 capped at max_backoff
        (((0.0, 2), (50.0, 3), (60.0, 3), (70.0, 2)), 80.0, 20.0),  # a same-size restart neither flips nor breaks
        (((0.0, 2), (50.0, 3), (150.0, 2)), 160.0, 20.0),  # a gap of exactly backoff_window is still "within"
        (((0.0, 2), (50.0, 3), (150.5, 2)), 160.0, 10.0),  # just outside the window: no reversal
        (((0.0, 2), (10.0, 3), (20.0, 2)), 120.0, 20.0),  # quiet for exactly backoff_window: still related
        (((0.0, 2), (10.0, 3), (20.0, 2)), 120.5, 10.0),  # quiet for longer: back to the base period
    ],
)
def test_required_stable_period(events: tuple[tuple[float, int], ...], now: float, expected: float) -> None:
    assert required_stable_period(_BACKOFF, tuple(ScaleEvent(at, n) for at, n in events), now) == expected


def test_required_stable_period_long_history_is_capped_without_overflow() -> None:
    policy = ElasticPolicy(
        min_replicas=1, max_replicas=2, min_stable_period=1, backoff_window=1e6, backoff_factor=1e6, max_backoff=1e6
    )
    events = tuple(ScaleEvent(float(i), 1 + i % 2) for i in range(5000))  # flapping 1, 2, 1, 2, ...
    assert required_stable_period(policy, events, 5000.0) == 1e6


# --------------------------------------------------------------------------- policy files

_EXPECTED = {"min_replicas": 1, "max_replicas": 8, "replica_increment_step": 2, "scaling_timeout": 30}

_YAML_BARE = "minReplicas: 1\nmaxReplicas: 8\nreplicaIncrementStep: 2\nscalingTimeoutInSeconds: 30\n"
_YAML_WRAPPED = "elasticPolicy:\n" + "".join(f"  {line}\n" for line in _YAML_BARE.splitlines())
_YAML_MANIFEST = (
    "apiVersion: sagemaker.amazonaws.com/v1\n"
    "kind: HyperPodPyTorchJob\n"
    "metadata:\n  name: llama-ft\n"
    "spec:\n"
    "  nprocPerNode: '8'\n"
    "  replicaSpecs:\n    - name: pods\n      replicas: 2\n"
    "  elasticPolicy:\n" + "".join(f"    {line}\n" for line in _YAML_BARE.splitlines())
)
_JSON_BARE = json.dumps({"minReplicas": 1, "maxReplicas": 8, "replicaIncrementStep": 2, "scalingTimeoutInSeconds": 30})


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("policy.yaml", _YAML_BARE),
        ("policy.yml", _YAML_WRAPPED),
        ("job.yaml", _YAML_MANIFEST),
        ("policy.json", _JSON_BARE),
        ("policy.json", json.dumps({"elasticPolicy": json.loads(_JSON_BARE)})),
        ("policy", _JSON_BARE),  # no extension: JSON first
        ("policy.conf", _YAML_MANIFEST),  # unknown extension: YAML after JSON fails
        ("policy.yaml", _YAML_BARE + "replicaDiscreteValues: null\n"),  # null = not set
    ],
)
def test_load_policy_file_formats(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert load_policy_file(path) == _EXPECTED


def test_load_policy_file_maps_every_key(tmp_path: Path) -> None:
    path = tmp_path / "all.yaml"
    path.write_text(
        "minReplicas: 2\nmaxReplicas: 16\nreplicaDiscreteValues: [2, 8, 16]\n"
        "gracefulShutdownTimeoutInSeconds: 300\nscalingTimeoutInSeconds: 45\n"
        "faultyScaleDownTimeoutInSeconds: 20\nminStablePeriodInSeconds: 30\n"
        "backoffWindowInSeconds: 1200\nbackoffFactor: 3\nmaxBackoffInSeconds: 900\n"
    )
    assert load_policy_file(path) == {
        "min_replicas": 2,
        "max_replicas": 16,
        "replica_discrete_values": (2, 8, 16),
        "graceful_shutdown_timeout": 300,
        "scaling_timeout": 45,
        "faulty_scale_down_timeout": 20,
        "min_stable_period": 30,
        "backoff_window": 1200,
        "backoff_factor": 3,
        "max_backoff": 900,
    }


@pytest.mark.parametrize(
    ("name", "text", "fragments"),
    [
        ("p.yaml", "minReplicas: 1\nminReplica: 2\n", ("unknown key 'minReplica'", "the top level")),
        (
            "p.yaml",
            "elasticPolicy:\n  maxReplicas: 2\n  maxReplica: 3\n",
            ("unknown key 'maxReplica'", "in elasticPolicy"),
        ),
        ("p.yaml", "spec:\n  elasticPolicy:\n    foo: 1\n", ("unknown key 'foo'", "spec.elasticPolicy")),
        ("p.yaml", "elasticPolicy:\n  minReplicas: 1\nextra: 2\n", ("unknown key 'extra' next to 'elasticPolicy'",)),
        ("p.yaml", "spec:\n  replicaSpecs: []\n", ("has no spec.elasticPolicy",)),
        ("p.yaml", "elasticPolicy: [1, 2]\n", ("elasticPolicy must be a mapping",)),
        ("p.yaml", "- 1\n- 2\n", ("expected a mapping, the file is a list",)),
        ("p.yaml", "", ("the file is empty",)),
        ("p.json", "{minReplicas: 1}", ("invalid JSON",)),
        ("p.yaml", "minReplicas: [1\n", ("invalid YAML",)),
    ],
)
def test_load_policy_file_errors_name_key_and_file(tmp_path: Path, name: str, text: str, fragments: tuple) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PolicyFileError) as info:
        load_policy_file(path)
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_load_policy_file_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(PolicyFileError, match="cannot read elastic policy file .*missing.yaml"):
        load_policy_file(path)


# --------------------------------------------------------------------------- build_policy


def test_flags_override_file_and_unset_flags_keep_file_values() -> None:
    policy = build_policy(
        file_values={"min_replicas": 1, "max_replicas": 8, "scaling_timeout": 30, "faulty_scale_down_timeout": 5},
        flag_values={"max_replicas": 4, "scaling_timeout": None, "faulty_scale_down_timeout": 9},
    )
    assert (policy.min_replicas, policy.max_replicas) == (1, 4)
    assert (policy.scaling_timeout, policy.faulty_scale_down_timeout) == (30.0, 9.0)


def test_build_from_file_end_to_end(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(_YAML_MANIFEST)
    policy = build_policy(file_values=load_policy_file(path), flag_values={}, file_path=path)
    assert policy == ElasticPolicy(min_replicas=1, max_replicas=8, replica_increment_step=2, scaling_timeout=30)
    assert policy.allowed_sizes() == (1, 3, 5, 7)


def test_flags_alone_and_discrete_list_from_flags() -> None:
    policy = build_policy(flag_values={"min_replicas": 2, "max_replicas": 8, "replica_discrete_values": [2, 8]})
    assert policy.allowed_sizes() == (2, 8)


@pytest.mark.parametrize(
    ("file_values", "flag_values", "fragments"),
    [
        (
            {"min_replicas": 4, "max_replicas": 8},
            {"max_replicas": 2},
            (
                "max_replicas (2) must be >= min_replicas (4)",
                "max_replicas=2 from --nnodes (MAX)",
                "min_replicas=4 from minReplicas in --elastic-policy p.yaml",
            ),
        ),
        (
            {"min_replicas": 1, "max_replicas": 8, "replica_discrete_values": (2, 4)},
            {"replica_increment_step": 2},
            (
                "mutually exclusive",
                "replica_increment_step=2 from --replica-increment-step",
                "replica_discrete_values=(2, 4) from replicaDiscreteValues in --elastic-policy p.yaml",
            ),
        ),
        (
            {"min_replicas": 1, "max_replicas": 8, "replica_discrete_values": (2, 16)},
            {},
            (
                "16 is outside",
                "replica_discrete_values=(2, 16) from replicaDiscreteValues",
                "max_replicas=8 from maxReplicas",
            ),
        ),
        (
            {"min_replicas": "2", "max_replicas": 8},
            {},
            ("min_replicas must be an integer, got '2'", "from minReplicas in --elastic-policy p.yaml"),
        ),
        (
            {"max_backoff": 1000},
            {"min_replicas": 1, "max_replicas": 2},
            ("max_backoff=1000 from maxBackoffInSeconds", "backoff_window=900.0 by default"),
        ),
    ],
)
def test_contradictions_name_fields_and_sources(file_values: dict, flag_values: dict, fragments: tuple) -> None:
    with pytest.raises(PolicyError) as info:
        build_policy(file_values=file_values, flag_values=flag_values, file_path="p.yaml")
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("file_values", "flag_values", "fragment"),
    [
        ({}, {"max_replicas": 4}, "min_replicas is not set: pass --nnodes MIN:MAX or set minReplicas"),
        ({"min_replicas": 1}, {}, "max_replicas is not set"),
        (
            {},
            {"min_replicas": 1, "max_replicas": 2, "max_restarts": 3},
            "unknown elastic policy setting 'max_restarts'",
        ),
    ],
)
def test_build_policy_rejects_missing_and_unknown(file_values: dict, flag_values: dict, fragment: str) -> None:
    with pytest.raises(PolicyError, match=fragment):
        build_policy(file_values=file_values, flag_values=flag_values)


@pytest.mark.parametrize(("text", "expected"), [("2,4,8", (2, 4, 8)), ("8", (8,)), (" 4, 2 ", (4, 2))])
def test_parse_replica_values(text: str, expected: tuple[int, ...]) -> None:
    assert parse_replica_values(text) == expected


def test_parse_replica_values_rejects_garbage() -> None:
    with pytest.raises(PolicyError, match="--replica-discrete-values: expected comma-separated integers"):
        parse_replica_values("2,x")
