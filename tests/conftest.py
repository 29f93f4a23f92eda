"""Fixtures shared by every test directory."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_events.contract import rank_context
from support.cluster import ElasticJob


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


@pytest.fixture(autouse=True)
def fresh_rank_context() -> Iterator[None]:
    """A rank reads its environment once (``rank_context()``); a test that sets the environment of its own
    process (monkeypatch.setenv) gets it read again, before and after."""
    rank_context.cache_clear()
    yield
    rank_context.cache_clear()


PHASE_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    """Each phase's report is kept on the test (``item.stash[PHASE_REPORTS]``) for fixtures that act on a failure."""
    report = yield
    item.stash.setdefault(PHASE_REPORTS, {})[report.when] = report
    return report


@pytest.fixture
def make_job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """Makes ElasticJobs (real launchers on this machine) in the test's directory; kills what is left at the end.
    A test that failed prints each job's post-mortem (event log and launchers' stderr tails) first."""
    jobs: list[ElasticJob] = []

    def make(**kwargs) -> ElasticJob:
        job = ElasticJob(tmp_path, **kwargs)
        jobs.append(job)
        return job

    yield make
    call = request.node.stash.get(PHASE_REPORTS, {}).get("call")
    for job in jobs:
        if call is not None and call.failed:
            print(job.post_mortem())
        job.close()
