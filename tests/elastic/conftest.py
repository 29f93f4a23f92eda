"""Fixtures for elastic jobs: a real etcd server (session), and an ElasticJob per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import ElasticJob
from support.etcd import EtcdServer


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    with EtcdServer() as server:
        yield server.endpoint


@pytest.fixture(params=["c10d", "etcd"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(``--rdzv-backend``, endpoint): the embedded store hosted by the first launcher, or a real etcd."""
    if request.param == "etcd":
        return "etcd", request.getfixturevalue("etcd_endpoint")
    return "c10d", None


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
