"""Per-world-size overrides (``scale_config``).

Some settings are tuned for a world size: the micro-batch that keeps a step fast
when each rank has few samples, the number of loader workers, or (against the
default of an unchanged learning rate) a learning rate. A scale config maps world
sizes to overrides, plus an optional ``default`` applied under every entry::

    # scale.yaml (JSON works too; a top-level "scale_config:" key is accepted)
    default: {micro_batch: 8, num_workers: 2}
    8:  {micro_batch: 4}
    16: {micro_batch: 2, num_workers: 1}

``resolve(world_size)`` returns ``default`` updated with the entry for the exact
world size; when there is none, with the entry of the largest configured world
size *below* it (settings known to work at a smaller scale), and when there is no
smaller one, ``default`` alone. ``resolve(world_size, exact=True)`` refuses to
fall back. Keys and values are validated against a schema (``DEFAULT_SCHEMA``, or
one passed in); errors name the file, the world size and the key::

    overrides = load_scale_config("scale.yaml").resolve(world_size)
    micro_batch = overrides.get("micro_batch", args.micro_batch)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

__all__ = [
    "DEFAULT_SCHEMA",
    "ScaleConfig",
    "ScaleConfigError",
    "load_scale_config",
    "parse_scale_config",
]

Validator = Callable[[Any], Any]  # returns the normalised value or raises ValueError(reason)


class ScaleConfigError(ValueError):
    """A scale config file or mapping is invalid, or has no entry for a world size."""


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"must be a positive int, got {value!r}")
    return value


def non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be a non-negative int, got {value!r}")
    return value


def positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive finite number, got {value!r}")
    return float(value)


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


DEFAULT_SCHEMA: Mapping[str, Validator] = MappingProxyType(
    {
        "global_batch": positive_int,
        "micro_batch": positive_int,
        "num_workers": non_negative_int,
        "prefetch_factor": positive_int,
        "lr": positive_float,
        "warmup_steps": non_negative_int,
        "activation_checkpointing": boolean,
    }
)


def _validated_overrides(where: str, overrides: Any, schema: Mapping[str, Validator]) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ScaleConfigError(f"{where}: overrides must be a mapping, got {type(overrides).__name__}")
    result = {}
    for key, value in overrides.items():
        if key not in schema:
            raise ScaleConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(schema))})")
        try:
            result[key] = schema[key](value)
        except ValueError as exc:
            raise ScaleConfigError(f"{where}: {key} {exc}") from None
    return result


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """Validated overrides by world size. Build with :func:`load_scale_config` or
    :func:`parse_scale_config`, or directly with int world sizes."""

    by_world_size: Mapping[int, Mapping[str, Any]]
    default: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<scale_config>"
    schema: Mapping[str, Validator] = field(default_factory=lambda: DEFAULT_SCHEMA)

    def __post_init__(self) -> None:
        if not isinstance(self.by_world_size, Mapping):
            raise ScaleConfigError(f"{self.source}: by_world_size must be a mapping")
        entries = {}
        for world_size, overrides in self.by_world_size.items():
            if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
                raise ScaleConfigError(f"{self.source}: world size {world_size!r} must be a positive int")
            where = f"{self.source}: world size {world_size}"
            entries[world_size] = MappingProxyType(_validated_overrides(where, overrides, self.schema))
        default = _validated_overrides(f"{self.source}: default", self.default, self.schema)
        object.__setattr__(self, "by_world_size", MappingProxyType(dict(sorted(entries.items()))))
        object.__setattr__(self, "default", MappingProxyType(default))

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """Configured world sizes, ascending."""
        return tuple(self.by_world_size)

    def entry_for(self, world_size: int, *, exact: bool = False) -> int | None:
        """The configured world size whose overrides apply to ``world_size`` (None: default only)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise ScaleConfigError(f"world_size must be a positive int, got {world_size!r}")
        if world_size in self.by_world_size:
            return world_size
        if exact:
            raise ScaleConfigError(
                f"{self.source}: no entry for world size {world_size} "
                f"(configured: {', '.join(map(str, self.world_sizes)) or 'none'})"
            )
        smaller = [size for size in self.by_world_size if size < world_size]
        return max(smaller) if smaller else None

    def resolve(self, world_size: int, *, exact: bool = False) -> dict[str, Any]:
        """``default`` updated with the overrides that apply at ``world_size``."""
        entry = self.entry_for(world_size, exact=exact)
        resolved = dict(self.default)
        if entry is not None:
            resolved.update(self.by_world_size[entry])
        return resolved


def parse_scale_config(
    data: Any, *, source: str = "<scale_config>", schema: Mapping[str, Validator] = DEFAULT_SCHEMA
) -> ScaleConfig:
    """A :class:`ScaleConfig` from a decoded YAML/JSON document (world sizes may be strings)."""
    if isinstance(data, Mapping) and set(data) == {"scale_config"}:
        data = data["scale_config"]
    if not isinstance(data, Mapping):
        raise ScaleConfigError(f"{source}: expected a mapping of world size to overrides, got {type(data).__name__}")
    by_world_size: dict[int, Any] = {}
    default: Any = {}
    for key, overrides in data.items():
        if key == "default":
            default = overrides
            continue
        if isinstance(key, str) and key.strip().isdigit():
            world_size = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            world_size = key
        else:
            raise ScaleConfigError(f"{source}: key {key!r} is neither a world size nor 'default'")
        if world_size in by_world_size:
            raise ScaleConfigError(f"{source}: world size {world_size} appears twice")
        by_world_size[world_size] = overrides
    return ScaleConfig(by_world_size=by_world_size, default=default, source=source, schema=schema)


def load_scale_config(path: str | os.PathLike[str], *, schema: Mapping[str, Validator] = DEFAULT_SCHEMA) -> ScaleConfig:
    """Read a scale config from a YAML file (``.json`` files are read as JSON)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScaleConfigError(f"{path}: cannot read scale config ({exc.strerror or exc})") from exc
    is_json = path.suffix.lower() == ".json"
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ScaleConfigError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {exc}") from None
    return parse_scale_config(data, source=str(path), schema=schema)
