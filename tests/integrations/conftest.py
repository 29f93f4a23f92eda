"""Fixtures for framework jobs under real launchers: an ElasticJob per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import ElasticJob


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator:
    jobs: list[ElasticJob] = []

    def make(**kwargs) -> ElasticJob:
        job = ElasticJob(tmp_path, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
