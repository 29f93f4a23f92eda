"""The round engine: how a rank moves from one round of the job to the next inside one process.

A round is one process group of the job's ranks. :mod:`.engine` holds a process's place in the
current round and carries it into the next: forming the round's group (:mod:`.group`), agreeing on
what every rank holds and bringing them to one state (:mod:`.hydration`, :mod:`.transfer`,
:mod:`.state`), in-memory snapshots of sharded models (:mod:`.snapshot`, :mod:`.snapshot_restore`),
ending a broken round's collectives (:mod:`.abort`) and handing a blocked rank's state to its
replacement (:mod:`.blocked_handoff`, :mod:`.handoff`). :mod:`.spare` is the process a node starts ahead of a failure.
"""
