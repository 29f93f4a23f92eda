"""Reaching a job's store and reading its records: :class:`ConnectionSettings`, :func:`read_job`.

``hyperpodctl`` takes the job's own ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``/
``--rdzv-conf`` (so ``PET_RDZV_*`` of the job's environment work unchanged) and only ever
connects: an embedded store lives in one of the job's agents.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hyperpodrun.config import parse_rdzv_conf, split_rdzv_conf
from hyperpodrun.ctl.status import JobRecords
from hyperpodrun.errors import ConfigError
from hyperpodrun.rendezvous.records import (
    ClosedRecord,
    EventRecord,
    HistoryEntry,
    Keys,
    NodeRecord,
    RoundRecord,
    cap_of,
    decode,
    decode_list,
    decode_prefix,
)
from hyperpodrun.store import STORE_CONF_KEYS, Store, backend_spec, check_store_conf, create_store, job_prefix

__all__ = ["ConnectionSettings", "read_job", "store_conf"]


def store_conf(rdzv_conf: str, backend: str) -> dict[str, str]:
    """The store's keys of the job's ``--rdzv-conf``; the rendezvous' settings are checked, then ignored.

    A key that is neither (a typo) is an error listing the known keys, as at launch.
    """
    conf = parse_rdzv_conf(rdzv_conf)
    store = {k: v for k, v in conf.items() if k in STORE_CONF_KEYS}
    check_store_conf(backend, store)  # e.g. TLS keys with an embedded store
    split_rdzv_conf({k: v for k, v in conf.items() if k not in store}, backend_spec(backend))
    return store


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """How to reach a job's store; ``endpoint`` empty means ``127.0.0.1`` at the backend's port."""

    backend: str
    endpoint: str
    run_id: str
    conf: Mapping[str, str] = field(default_factory=dict)  # the store's --rdzv-conf keys
    timeout: float = 10.0

    def __post_init__(self) -> None:
        spec = backend_spec(self.backend)  # StoreConfigError names the flag
        job_prefix(self.run_id)  # StoreConfigError: not a valid --rdzv-id
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"--store-timeout: must be a number of seconds > 0, got {self.timeout!r}")
        if not self.endpoint.strip():
            object.__setattr__(self, "endpoint", f"127.0.0.1:{spec.default_port}")

    @classmethod
    def from_flags(
        cls, *, backend: str, endpoint: str, run_id: str, rdzv_conf: str, timeout: float
    ) -> ConnectionSettings:
        return cls(
            backend=backend, endpoint=endpoint, run_id=run_id, conf=store_conf(rdzv_conf, backend), timeout=timeout
        )

    def connect(self) -> Store:
        """A client of the job's store; never hosts one (an embedded store lives in an agent)."""
        hosted = backend_spec(self.backend).hosted
        return create_store(
            self.backend,
            self.endpoint,
            run_id=self.run_id,
            conf=dict(self.conf),
            host=False if hosted else None,  # etcd is never hosted; host= must stay unset
            timeout=self.timeout,
        )


def _value(store: Store, key: str) -> bytes | None:
    entry = store.get(key)
    return entry.value if entry is not None else None


def read_job(store: Store) -> JobRecords:
    """Read every record ``status`` needs (one request per key; each is self-consistent)."""
    return JobRecords(
        nodes=decode_prefix(NodeRecord, store.get_prefix(Keys.NODES)),
        round=decode(RoundRecord, Keys.ROUND, _value(store, Keys.ROUND)),
        event=decode(EventRecord, Keys.EVENT, _value(store, Keys.EVENT)),
        cap=cap_of(_value(store, Keys.CAP)),
        closed=decode(ClosedRecord, Keys.CLOSED, _value(store, Keys.CLOSED)),
        history=tuple(decode_list(HistoryEntry, Keys.HISTORY, _value(store, Keys.HISTORY))),
    )
