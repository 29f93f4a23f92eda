"""Errors of the rank side (``ElasticTraining`` and its round engine): one base, one class per failure."""

from __future__ import annotations


class ElasticTrainingError(RuntimeError):
    """The in-process API could not carry the rank into the next round; the message says why."""


class GroupError(ElasticTrainingError):
    """The new round's process group could not be formed."""


class HydrationError(ElasticTrainingError):
    """A newcomer could not be given the training state."""


class StateMismatchError(HydrationError):
    """The ranks of a round hold state that does not agree; training on it would be wrong."""


class RecoveryError(ElasticTrainingError):
    """A rank whose collective failed was not carried into a repaired group (no repair came, or it failed)."""


class PeerFailureError(RuntimeError):
    """A peer died or hung while this rank waited on it outside a collective (e.g. for a snapshot):
    :meth:`~elastic_events.training.ElasticTraining.recover` treats it like a failed collective."""


class StepAbandonedError(PeerFailureError):
    """A step's collectives did not complete (a peer failed, the round was aborted, or its deadline passed):
    nothing of the step was applied. :meth:`~elastic_events.training.ElasticTraining.recover` takes it up."""

    def __init__(self, step: int, why: str) -> None:
        super().__init__(f"step {step} abandoned before its optimizer step: {why}")
        self.step, self.why = step, why
