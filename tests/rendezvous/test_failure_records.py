"""A node's failure record in its round, written through a real store (the embedded c10d one).

The decider reads a round's failure records to tell a rank failure (repaired by replacing the rank) from a
node lost elsewhere (reported by the ranks whose collectives failed on it). A node with several ranks can
report both: its other ranks' collectives fail on the rank that died before its agent sees that rank die.
"""

from __future__ import annotations

from hyperpodrun.rendezvous import LocalStatus
from hyperpodrun.rendezvous.elastic import ElasticRendezvous
from hyperpodrun.rendezvous.records import FailedRecord, Keys, decode
from hyperpodrun.store import create_store
from hyperpodrun.supervisor import WorkerState
from support.decider import one_node_context


def status(**fields: object) -> LocalStatus:
    return LocalStatus(steps=(5, 5), step_times=(0.1, 0.1), **{"group_state": WorkerState.HEALTHY, **fields})


def test_a_nodes_own_rank_failure_replaces_the_peer_failure_its_sibling_reported_first() -> None:
    store = create_store("c10d", "127.0.0.1:0", run_id="failed", conf={}, host=True, timeout=10.0)
    rdzv = ElasticRendezvous(
        store,
        context=one_node_context(nproc_per_node=2, max_restarts=3),
        local_addr="127.0.0.1",
        join_timeout=20.0,
        node_id="a",
    )

    def record() -> FailedRecord | None:
        key = Keys.failed(rnd.round) + "a"
        entry = store.get(key)
        return decode(FailedRecord, key, entry.value if entry is not None else None)

    try:
        rdzv.join()
        rnd = rdzv.next_round(timeout=20.0)
        rdzv.poll(status(peer_failed=True))  # local rank 0's collective failed on rank 1 ...
        assert record() == FailedRecord(
            message="a collective failed on a: a peer died or hung", repairable=True, peer=True
        )
        crash = "rank 1 (local rank 1, pid 4242) exited with code -9 (SIGKILL)"
        rdzv.poll(status(failure=crash, repairing=True))  # ... which the agent then saw die and replaced
        assert record() == FailedRecord(message=crash, repairable=True)
        rdzv.report_failure("a later failure of the same round", repairable=False)
        assert record() == FailedRecord(message=crash, repairable=True)  # the first of this node's own stands
    finally:
        rdzv.shutdown(succeeded=False)
