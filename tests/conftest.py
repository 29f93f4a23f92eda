"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import ElasticJob


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator:
    """Makes ElasticJobs (real launchers on this machine) in the test's directory; kills what is left at the end."""
    jobs: list[ElasticJob] = []

    def make(**kwargs) -> ElasticJob:
        job = ElasticJob(tmp_path, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
