"""One real Slurm cluster (tests/support/slurm.py) for the whole session: three logical nodes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.slurm import SlurmCluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
