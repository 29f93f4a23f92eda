"""Key-value stores for rendezvous and membership: etcd v3, or embedded in one agent.

Start from :func:`create_store`; the rest of the launcher depends only on :class:`Store`.
"""

from hyperpodrun.store.base import (
    KEY_ROOT,
    Entry,
    Lease,
    LeaseExpiredError,
    LeaseKeeper,
    PrefixedStore,
    Store,
    StoreAddressInUseError,
    StoreAuthError,
    StoreClosedError,
    StoreConfigError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    job_prefix,
)
from hyperpodrun.store.embedded import (
    EmbeddedHostNotLocalError,
    EmbeddedStoreClient,
    EmbeddedStoreGoneError,
    EmbeddedStoreServer,
)
from hyperpodrun.store.etcd import EtcdConfig, EtcdStore
from hyperpodrun.store.factory import (
    BACKEND_SPECS,
    BACKENDS,
    STORE_CONF_KEYS,
    BackendSpec,
    backend_spec,
    check_store_conf,
    create_store,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "BACKEND_SPECS",
    "BackendSpec",
    "backend_spec",
    "KEY_ROOT",
    "STORE_CONF_KEYS",
    "EmbeddedHostNotLocalError",
    "EmbeddedStoreClient",
    "EmbeddedStoreGoneError",
    "EmbeddedStoreServer",
    "Entry",
    "EtcdConfig",
    "EtcdStore",
    "Lease",
    "LeaseExpiredError",
    "LeaseKeeper",
    "PrefixedStore",
    "Store",
    "StoreAddressInUseError",
    "StoreAuthError",
    "StoreClosedError",
    "StoreConfigError",
    "StoreError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "check_store_conf",
    "create_store",
    "job_prefix",
    "resolve_backend",
]
