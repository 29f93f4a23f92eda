"""What the launcher refuses or hides for safety: job ids, secrets in the ranks' environment.

See ``docs/security.md`` for the threat model these pieces serve.

* :func:`run_id_problem` -- ``--rdzv-id`` reaches log paths and store keys, so it is held to
  a DNS-label-like pattern before any use.
* :func:`scrub_secrets` -- the training processes get the agent's environment, minus the
  store's credentials: they never talk to the store, and a script that logs or ships its
  environment (experiment trackers do) must not leak them.
* :data:`SECURITY_CONF_KEYS` -- the ``--rdzv-conf`` keys this module's settings add.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "RUN_ID_MAX_LENGTH",
    "SECRET_ENV_VARS",
    "SECURITY_CONF_KEYS",
    "STORE_SECRET_ENV",
    "run_id_problem",
    "scrub_secrets",
]

#: ``--rdzv-conf`` keys added here: ``secret_file`` (path of the embedded store's shared
#: secret) and ``insecure`` (``true`` allows an etcd password over plain http).
SECURITY_CONF_KEYS: tuple[str, ...] = ("secret_file", "insecure")

#: Environment variable holding the embedded store's shared secret (``secret_file`` wins).
STORE_SECRET_ENV = "HYPERPODRUN_STORE_SECRET"

#: Variables removed from the ranks' environment outright.
SECRET_ENV_VARS: tuple[str, ...] = (STORE_SECRET_ENV, "ETCDCTL_PASSWORD", "ETCDCTL_USER")

#: ``--rdzv-conf`` items removed from ``PET_RDZV_CONF`` in the ranks' environment.
_SECRET_CONF_WORDS = ("password", "passwd", "secret", "token")

RUN_ID_MAX_LENGTH = 63
_RUN_ID_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` is not a valid ``--rdzv-id`` (``None`` if it is).

    Like a DNS label: 1 to 63 letters, digits, ``-``, ``_`` or ``.``, starting and ending
    with a letter or digit, so it is safe as a path component and a store key segment.
    """
    if not isinstance(run_id, str) or not run_id:
        return "--rdzv-id must be a non-empty string"
    if len(run_id) > RUN_ID_MAX_LENGTH:
        return f"--rdzv-id {run_id[:20]!r}... is {len(run_id)} characters long; the limit is {RUN_ID_MAX_LENGTH}"
    if not _RUN_ID_RE.fullmatch(run_id):
        return (
            f"--rdzv-id {run_id!r} is not a valid job id: use letters, digits, '.', '_' and '-', "
            "starting and ending with a letter or digit"
        )
    return None


def _is_secret_item(item: str) -> bool:
    key = item.partition("=")[0].strip().lower()
    return any(word in key for word in _SECRET_CONF_WORDS) and key != "secret_file"


def scrub_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the store's credentials, for the training processes.

    Drops :data:`SECRET_ENV_VARS` and removes ``password=``/``secret=``/``token=`` items
    from ``PET_RDZV_CONF`` (the other items stay, so scripts that read it still work).
    """
    out = {k: v for k, v in env.items() if k not in SECRET_ENV_VARS}
    conf = out.get("PET_RDZV_CONF")
    if conf is not None:
        kept = [item for item in conf.split(",") if item.strip() and not _is_secret_item(item)]
        if kept:
            out["PET_RDZV_CONF"] = ",".join(kept)
        else:
            del out["PET_RDZV_CONF"]
    return out
