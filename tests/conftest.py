"""Session-wide test settings."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary files of everything the tests run (the default log folders of failed jobs,
    kept on purpose for users) go under pytest's own temporary tree, not the system one."""
    path = tmp_path_factory.mktemp("tmpdir")
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(path))
    patch.setattr(tempfile, "tempdir", str(path))
    yield
    patch.undo()
