"""Names shared by the launcher and the training script: environment variables and trainer records.

Defined here once (``elastic_events`` never imports ``hyperpodrun``; the launcher, the demo and
the benchmarks import these), so a rename cannot leave one side behind.
"""

from __future__ import annotations

# Environment the agent gives every rank, beyond torchrun's variables.
CONTROL_FILE_ENV = "HYPERPODRUN_CONTROL_FILE"  # the node-local control channel
RESTART_REASON_ENV = "HYPERPODRUN_RESTART_REASON"  # start, scale or failure
ROUND_ENV = "HYPERPODRUN_ROUND"  # the rendezvous round the rank starts in
NODE_ID_ENV = "HYPERPODRUN_NODE_ID"
EVENT_LOG_ENV = "HYPERPODRUN_EVENT_LOG"  # where trainer records go (JSON lines, shared with the agent)
PARKED_ENV = "HYPERPODRUN_PARKED"  # "1": a pre-warmed joiner, no rank until admitted
SNAPSHOT_EVERY_ENV = "HYPERPODRUN_SNAPSHOT_EVERY"  # --snapshot-every: a sharded model's in-memory snapshots
ENV_PREFIX = "HYPERPODRUN_"

# Records the ranks append to the event log (the agent's own are hyperpodrun.events.EventType).
FIRST_STEP = "first_step"
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_LOADED = "checkpoint_loaded"
GROUP_TORN_DOWN = "group_torn_down"
GROUP_UP = "group_up"
HYDRATED = "hydrated"
PEER_FAILED = "peer_failed"  # a collective failed: the rank waits for its group to be repaired
SNAPSHOT_RESTORED = "snapshot_restored"  # a sharded model's state put back together from snapshots after a failure
SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"  # no step at which every shard survived: the checkpoint instead
