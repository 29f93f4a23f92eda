"""Fixtures for the store tests: a real etcd per session, a fresh embedded server per test."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator

import pytest

from hyperpodrun.store import EmbeddedStoreServer, Store, create_store
from hyperpodrun.store.auth import new_secret
from support.etcd import EtcdServer

BACKEND_NAMES = ["etcd", "embedded"]


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@dataclasses.dataclass
class Backend:
    """One running store server and a way to open more clients of it."""

    name: str
    endpoint: str
    #: The shortest lease the backend grants (etcd's floor is 2 s with default flags).
    lease_ttl: float
    stack: contextlib.ExitStack

    def open(self, run_id: str) -> Store:
        """A new client (as another agent would have) scoped to the job ``run_id``."""
        host = False if self.name == "embedded" else None
        store = create_store(self.name, self.endpoint, run_id=run_id, conf={}, host=host, timeout=10.0)
        self.stack.callback(store.close)
        return store


def _new_run_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_run_id() -> Callable[[], str]:
    """Makes fresh job ids, so tests sharing the session's etcd never meet."""
    return _new_run_id


@pytest.fixture
def run_id() -> str:
    return _new_run_id()


@pytest.fixture(params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    with contextlib.ExitStack() as stack:
        if request.param == "etcd":
            server: EtcdServer = request.getfixturevalue("etcd_server")
            yield Backend("etcd", server.endpoint, lease_ttl=2.0, stack=stack)
        else:
            # as an agent hosts it: a secret of its own, published for this user's other agents
            embedded = stack.enter_context(
                EmbeddedStoreServer("127.0.0.1", 0, secret=new_secret(), publish_secret=True)
            )
            yield Backend("embedded", embedded.endpoint, lease_ttl=1.0, stack=stack)


@pytest.fixture
def store(backend: Backend, run_id: str) -> Store:
    return backend.open(run_id)
