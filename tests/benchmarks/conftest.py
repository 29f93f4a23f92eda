"""What the benchmark tests share: benchmarks/ importable as the scripts import each other."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[Callable[[str], ModuleType]]:
    """Import benchmark modules by name from benchmarks/ (they import ``common`` as scripts do)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH_DIR))
