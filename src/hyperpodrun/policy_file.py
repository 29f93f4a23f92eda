"""Building an :class:`~hyperpodrun.policy.ElasticPolicy` from a policy file and CLI flags.

``--elastic-policy FILE`` takes YAML or JSON with HyperPod's ``elasticPolicy`` field names,
as a bare mapping, as ``{elasticPolicy: {...}}`` or as a full HyperPod job manifest
(``spec.elasticPolicy``). Flags the user passed override the file; settings that then
contradict each other are rejected with a message saying where each value came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hyperpodrun.policy import ElasticPolicy, PolicyError

__all__ = ["FILE_KEYS", "FLAG_NAMES", "PolicyFileError", "build_policy", "load_policy_file", "parse_replica_values"]


class PolicyFileError(PolicyError):
    """The policy file cannot be read, parsed, or has an unknown key."""


FILE_KEYS: Mapping[str, str] = {
    # HyperPod's elasticPolicy fields.
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "replicaIncrementStep": "replica_increment_step",
    "replicaDiscreteValues": "replica_discrete_values",
    "gracefulShutdownTimeoutInSeconds": "graceful_shutdown_timeout",
    "scalingTimeoutInSeconds": "scaling_timeout",
    "faultyScaleDownTimeoutInSeconds": "faulty_scale_down_timeout",
    # hyperpodrun's anti-thrashing settings, named in the same style.
    "minStablePeriodInSeconds": "min_stable_period",
    "backoffWindowInSeconds": "backoff_window",
    "backoffFactor": "backoff_factor",
    "maxBackoffInSeconds": "max_backoff",
}
"""Policy file key -> :class:`ElasticPolicy` field."""

FLAG_NAMES: Mapping[str, str] = {
    "min_replicas": "--nnodes (MIN)",
    "max_replicas": "--nnodes (MAX)",
    "replica_increment_step": "--replica-increment-step",
    "replica_discrete_values": "--replica-discrete-values",
    "graceful_shutdown_timeout": "--graceful-shutdown-timeout",
    "scaling_timeout": "--scaling-timeout",
    "faulty_scale_down_timeout": "--faulty-scale-down-timeout",
    "min_stable_period": "--min-stable-period",
    "backoff_window": "--backoff-window",
    "backoff_factor": "--backoff-factor",
    "max_backoff": "--max-backoff",
}
""":class:`ElasticPolicy` field -> the CLI flag that sets it (for error messages)."""

_FIELD_TO_KEY = {f: k for k, f in FILE_KEYS.items()}
_POLICY_FIELDS = {f.name: f for f in dataclasses.fields(ElasticPolicy) if f.init}
_SECTION = "elasticPolicy"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _parse(text: str, path: Path) -> object:
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise PolicyFileError(f"elastic policy file {path}: invalid JSON: {_one_line(err)}") from None
    if suffix not in (".yaml", ".yml"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass  # not JSON: YAML (a superset for our purposes) gets the final word
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyFileError(f"elastic policy file {path}: invalid YAML: {_one_line(err)}") from None


def _section(doc: object, path: Path) -> tuple[Mapping[Any, Any], str]:
    """The elasticPolicy mapping in ``doc`` and where it was found."""
    if not isinstance(doc, dict):
        kind = "empty" if doc is None else f"a {type(doc).__name__}"
        raise PolicyFileError(f"elastic policy file {path}: expected a mapping, the file is {kind}")
    if "spec" in doc:
        spec = doc["spec"]
        if not isinstance(spec, dict) or _SECTION not in spec:
            raise PolicyFileError(f"elastic policy file {path}: the job manifest has no spec.{_SECTION}")
        section, where = spec[_SECTION], f"spec.{_SECTION}"
    elif _SECTION in doc:
        extra = [k for k in doc if k != _SECTION]
        if extra:
            raise PolicyFileError(
                f"elastic policy file {path}: unknown key {extra[0]!r} next to {_SECTION!r} at the top level"
            )
        section, where = doc[_SECTION], _SECTION
    else:
        section, where = doc, "the top level"
    if not isinstance(section, dict):
        raise PolicyFileError(f"elastic policy file {path}: {where} must be a mapping, got {section!r}")
    return section, where


def load_policy_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON policy file; returns its values keyed by :class:`ElasticPolicy` field.

    The format follows the extension (``.json``, ``.yaml``/``.yml``); any other extension is
    tried as JSON, then YAML. Keys set to null are left out. Values are type-checked when
    the policy is built (:func:`build_policy`).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PolicyFileError(f"cannot read elastic policy file {path}: {_one_line(err)}") from None
    section, where = _section(_parse(text, path), path)
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in FILE_KEYS:
            raise PolicyFileError(
                f"elastic policy file {path}: unknown key {key!r} in {where}; expected one of {', '.join(FILE_KEYS)}"
            )
        if value is None:
            continue
        if isinstance(value, list):
            value = tuple(value)
        values[FILE_KEYS[key]] = value
    return values


def parse_replica_values(text: str, *, flag: str = "--replica-discrete-values") -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)``, order kept (the policy rejects unsorted values)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise PolicyError(
            f"{flag}: expected comma-separated integers, got {text!r}", fields=("replica_discrete_values",)
        ) from None
    return values


def build_policy(
    *,
    file_values: Mapping[str, Any] | None = None,
    flag_values: Mapping[str, Any] | None = None,
    file_path: str | os.PathLike[str] | None = None,
) -> ElasticPolicy:
    """Merge policy-file values and CLI flags (flags win) into a validated policy.

    Both mappings are keyed by :class:`ElasticPolicy` field; a value of None means "not
    given" (pass None, not torchrun's default, for a flag the user did not type).
    ``file_path`` only names the file in error messages.
    """
    file_values = dict(file_values or {})
    flag_values = dict(flag_values or {})
    file_label = f"--elastic-policy {file_path}" if file_path is not None else "the policy file"
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for values, describe in (
        (file_values, lambda f: f"{_FIELD_TO_KEY[f]} in {file_label}"),
        (flag_values, lambda f: FLAG_NAMES[f]),
    ):
        for name, value in values.items():
            if name not in _POLICY_FIELDS:
                raise PolicyError(f"unknown elastic policy setting {name!r}", fields=(name,))
            if value is None:
                continue
            merged[name] = tuple(value) if isinstance(value, list) else value
            origin[name] = describe(name)
    for name in ("min_replicas", "max_replicas"):
        if name not in merged:
            raise PolicyError(
                f"{name} is not set: pass --nnodes MIN:MAX or set {_FIELD_TO_KEY[name]} in --elastic-policy FILE",
                fields=(name,),
            )
    try:
        return ElasticPolicy(**merged)
    except PolicyError as err:
        sources = "; ".join(_describe(name, merged, origin) for name in err.fields)
        raise PolicyError(f"{err} [{sources}]" if sources else str(err), fields=err.fields) from None


def _describe(name: str, merged: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    if name in origin:
        return f"{name}={merged[name]!r} from {origin[name]}"
    return f"{name}={_POLICY_FIELDS[name].default!r} by default"
