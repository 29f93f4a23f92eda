"""Fixtures for elastic jobs: a real etcd server (session); make_job is in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
