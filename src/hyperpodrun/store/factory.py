"""Build the store a job's agents share from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-conf``.

Backends:

* ``etcd`` (alias ``etcd-v3``): an etcd v3 cluster, ``host:port[,host:port...]``.
  ``--rdzv-conf`` keys ``cacert``, ``cert``, ``key``, ``protocol`` (TLS) and ``user``,
  ``password`` (etcd authentication; refused over plain http unless ``insecure=true``) apply.
* ``embedded``: a store hosted inside one agent (see :mod:`hyperpodrun.store.embedded`).
  ``--rdzv-conf secret_file`` (or ``HYPERPODRUN_STORE_SECRET``) names the shared secret
  every connection must prove; required unless the endpoint is loopback (see
  :mod:`hyperpodrun.store.auth`).
  torchrun's ``c10d`` and ``static`` are accepted as aliases of it, so torchrun command
  lines work unchanged: like c10d's TCPStore, the store lives in one agent and the job
  ends with that agent. (``static`` rendezvous itself needs no store; when one is asked
  for, e.g. for the event log or ``hyperpodctl``, it is the embedded one.)

Every backend's store is returned scoped to the job (:func:`job_prefix` of ``run_id``),
so several jobs can share one etcd without seeing each other's keys.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from hyperpodrun.security import STORE_SECRET_ENV
from hyperpodrun.store.auth import is_loopback, loopback_name, new_secret, resolve_store_secret
from hyperpodrun.store.base import (
    PrefixedStore,
    Store,
    StoreAddressInUseError,
    StoreConfigError,
    job_prefix,
    parse_endpoint,
)
from hyperpodrun.store.embedded import DEFAULT_PORT as EMBEDDED_DEFAULT_PORT
from hyperpodrun.store.embedded import EmbeddedHostNotLocalError, EmbeddedStoreClient, EmbeddedStoreServer
from hyperpodrun.store.etcd import EtcdConfig, EtcdStore

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "BACKEND_SPECS",
    "BackendSpec",
    "STORE_CONF_KEYS",
    "backend_spec",
    "check_store_conf",
    "create_store",
    "resolve_backend",
]


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """One ``--rdzv-backend`` value: the store it selects and what that store takes."""

    name: str
    kind: str  # "etcd" or "embedded": the store implementation
    default_port: int
    conf_keys: tuple[str, ...] = ()  # --rdzv-conf keys the store consumes
    hosted: bool = False  # the store lives inside one agent (the job ends with that agent)


#: ``--rdzv-conf`` keys the stores consume, per backend kind (see docs/security.md for
#: ``insecure`` and ``secret_file``).
_ETCD_KEYS: tuple[str, ...] = ("cacert", "cert", "key", "protocol", "user", "password", "insecure")
_EMBEDDED_KEYS: tuple[str, ...] = ("secret_file",)
STORE_CONF_KEYS: tuple[str, ...] = _ETCD_KEYS + _EMBEDDED_KEYS

# A BackendSpec of each store kind, given its --rdzv-backend name.
_ETCD = partial(BackendSpec, kind="etcd", default_port=2379, conf_keys=_ETCD_KEYS)
_EMBEDDED = partial(
    BackendSpec, kind="embedded", default_port=EMBEDDED_DEFAULT_PORT, conf_keys=_EMBEDDED_KEYS, hosted=True
)

#: ``--rdzv-backend`` spellings and the store each one selects.
BACKEND_SPECS: Mapping[str, BackendSpec] = {
    "etcd": _ETCD(name="etcd"),
    "etcd-v3": _ETCD(name="etcd-v3"),
    "embedded": _EMBEDDED(name="embedded"),
    "c10d": _EMBEDDED(name="c10d"),
    "static": _EMBEDDED(name="static"),
}
BACKENDS: Mapping[str, str] = {name: spec.kind for name, spec in BACKEND_SPECS.items()}


def backend_spec(backend: str) -> BackendSpec:
    """The :class:`BackendSpec` of a ``--rdzv-backend`` value (either spelling, any case)."""
    spec = BACKEND_SPECS.get(backend.strip().lower().replace("_", "-"))
    if spec is None:
        raise StoreConfigError(f"unknown --rdzv-backend {backend!r}; valid backends: {', '.join(BACKEND_SPECS)}")
    return spec


# Words that only make sense in a store/TLS/auth key: a key containing one of them that is
# not in STORE_CONF_KEYS is a typo, not a rendezvous option.
_STORE_WORDS = frozenset(
    {
        "ca",
        "cafile",
        "cacrt",
        "cert",
        "certfile",
        "certificate",
        "crt",
        "keyfile",
        "key",
        "tls",
        "ssl",
        "https",
        "user",
        "username",
        "password",
        "passwd",
        "pass",
        "token",
        "secret",
        "insecure",
    }
)


def resolve_backend(backend: str) -> str:
    """The implementation (``"etcd"`` or ``"embedded"``) for a ``--rdzv-backend`` value."""
    return backend_spec(backend).kind


def check_store_conf(backend: str, conf: Mapping[str, str]) -> None:
    """Reject store keys the backend cannot use and misspelt store keys, naming the key."""
    kind = resolve_backend(backend)
    for key, value in conf.items():
        if key in STORE_CONF_KEYS:
            if (key in _ETCD_KEYS) != (kind == "etcd"):
                wanted = "etcd" if key in _ETCD_KEYS else "embedded, c10d or static"
                raise StoreConfigError(
                    f"--rdzv-conf {key}=... applies only to --rdzv-backend {wanted}, not {backend!r}"
                )
            if value is None or value == "":
                raise StoreConfigError(f"--rdzv-conf {key} needs a value")
            continue
        words = set(re.split(r"[^a-z0-9]+", key.lower()))
        misspelt = difflib.get_close_matches(key.lower(), STORE_CONF_KEYS, n=1, cutoff=0.8)
        if words & _STORE_WORDS or misspelt:
            near = difflib.get_close_matches(key.lower(), STORE_CONF_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise StoreConfigError(
                f"unknown --rdzv-conf key {key!r}{hint}; the store's keys are {', '.join(STORE_CONF_KEYS)}"
            )


def _etcd_config(endpoint: str, conf: Mapping[str, str], timeout: float) -> EtcdConfig:
    endpoints = tuple(e.strip() for e in endpoint.split(",") if e.strip())
    if not endpoints:
        raise StoreConfigError("--rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...]")
    protocol = conf.get("protocol")
    if protocol is not None:
        protocol = protocol.lower()
        if protocol not in ("http", "https"):
            raise StoreConfigError(f"--rdzv-conf protocol must be http or https, got {protocol!r}")
    insecure = conf.get("insecure", "false").lower()
    if insecure not in ("true", "false", "1", "0", "yes", "no"):
        raise StoreConfigError(f"--rdzv-conf insecure must be true or false, got {conf['insecure']!r}")
    return EtcdConfig(
        insecure=insecure in ("true", "1", "yes"),
        endpoints=endpoints,
        protocol=protocol,  # type: ignore[arg-type]  # checked just above
        cacert=conf.get("cacert"),
        cert=conf.get("cert"),
        key=conf.get("key"),
        user=conf.get("user"),
        password=conf.get("password"),
        connect_timeout=timeout,
    )


def _embedded_store(
    endpoint: str, host: bool | None, timeout: float, conf: Mapping[str, str], env: Mapping[str, str]
) -> EmbeddedStoreClient:
    endpoint = endpoint.strip() or f"127.0.0.1:{EMBEDDED_DEFAULT_PORT}"
    if "," in endpoint:
        raise StoreConfigError(f"the embedded store takes one --rdzv-endpoint, got {endpoint!r}")
    address, port = parse_endpoint(endpoint, default_port=EMBEDDED_DEFAULT_PORT)
    secret = resolve_store_secret(conf, env)
    if (loopback := loopback_name(address)) is not None:
        # --rdzv-endpoint $(hostname):PORT where /etc/hosts maps the name to loopback: the store is this machine's only
        logger.warning(
            "--rdzv-endpoint %s: %s resolves to %s (loopback) on this machine, so agents on other machines "
            "cannot reach the store there; give an address they can reach",
            endpoint,
            address,
            loopback,
        )
    if secret is None and not is_loopback(address) and loopback is None:
        raise StoreConfigError(
            f"the embedded store at {endpoint} is reachable from other hosts, so the job needs a shared "
            f"secret: set --rdzv-conf secret_file=PATH (or {STORE_SECRET_ENV}) on every node"
        )
    if host is False:
        return EmbeddedStoreClient(endpoint, connect_timeout=timeout, secret=secret, require_secret=True)
    # One host, no secret given: generate one and leave it where this user's agents find it.
    server = EmbeddedStoreServer(address, port, secret=secret or new_secret(), publish_secret=secret is None)
    try:
        server.start()
    except (StoreAddressInUseError, EmbeddedHostNotLocalError):
        if host:
            raise
        # Another program holds the address: join it only if it proves this job's secret (an agent of this
        # user on this host publishes it; another user's program cannot).
        return EmbeddedStoreClient(endpoint, connect_timeout=timeout, secret=secret, require_secret=True)
    try:
        return EmbeddedStoreClient(server.endpoint, connect_timeout=timeout, secret=server.secret, server=server)
    except BaseException:
        server.close()
        raise


def create_store(
    backend: str,
    endpoint: str,
    *,
    run_id: str,
    conf: Mapping[str, str],
    host: bool | None = None,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> Store:
    """Connect to (or, for the embedded backend, host) the job's store.

    Args:
        backend: ``--rdzv-backend`` (see :data:`BACKENDS`).
        endpoint: ``--rdzv-endpoint``; etcd takes a comma-separated list to fail over across.
        run_id: ``--rdzv-id``; the returned store sees only this job's keys.
        conf: ``--rdzv-conf`` as a mapping; see :data:`STORE_CONF_KEYS`.
        host: embedded only. ``True``: host the store on ``endpoint`` (error if the address
            is taken); ``False``: only connect; ``None``: host it unless another agent
            already does or the address is not this machine's, then connect.
            The store of a hosting agent owns the server: closing it ends the job's store.
        timeout: how long to keep trying to reach the store before
            :class:`~hyperpodrun.store.base.StoreUnavailableError`.
        env: where ``HYPERPODRUN_STORE_SECRET`` is looked up (default ``os.environ``).

    Raises:
        StoreConfigError: unknown backend, bad endpoint or conf key, before connecting.
    """
    kind = resolve_backend(backend)
    prefix = job_prefix(run_id)
    check_store_conf(backend, conf)
    if not timeout > 0:
        raise StoreConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
    if kind == "etcd":
        if host is not None:
            raise StoreConfigError("host= applies only to the embedded store; etcd is never hosted by an agent")
        inner: Store = EtcdStore(_etcd_config(endpoint, conf, timeout))
    else:
        inner = _embedded_store(endpoint, host, timeout, conf, os.environ if env is None else env)
    return PrefixedStore(inner, prefix)
