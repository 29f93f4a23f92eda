"""ElasticConfig: its validation, and what ``freeze_gc`` does to the process that starts training."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from elastic_events.rounds.config import ElasticConfig, ElasticConfigError
from support.launch import clean_env


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 0),
        ("admission_timeout_s", -1.0),
        ("poll_s", True),
        ("collective_timeout_s", 0),
        ("peer_failure_grace_s", float("nan")),
        ("commit_check", 1),
        ("bucket_mb", "64"),
        ("backend", "mpi"),
        ("snapshot_every", -1),
        ("snapshot_every", "often"),
        ("snapshot_overhead", 0),
        ("snapshot_overhead", 1.5),
        ("mtbf_s", 0),
        ("freeze_gc", 1),
    ],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ElasticConfigError, match=rf"^ElasticConfig\.{field} must be"):
        ElasticConfig(**{field: value})


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_what_exists_at_start_is_frozen_and_the_model_built_after_stays_collectable(freeze_gc: bool) -> None:
    """With freeze_gc, start() freezes the imports before the model is built: a model dropped later and held
    only by a reference cycle (as FSDP2's hooks hold a sharded one) is still collected, and the full
    collection that frees it no longer scans the ~10^5 objects of the imports."""
    code = f"""
        import gc, json, weakref
        import torch
        from elastic_events.training import ElasticTraining
        from elastic_events.rounds.config import ElasticConfig, ElasticConfigError

        before = gc.get_freeze_count()
        el = ElasticTraining(model_fn=lambda: torch.nn.Linear(4, 4), config=ElasticConfig(freeze_gc={freeze_gc})).start()
        model = el.module
        model.cycle = model
        alive = weakref.ref(model)
        del model
        el.state.module = el.state.model = el.state.optimizer = None
        gc.collect()
        print(json.dumps({{"frozen": gc.get_freeze_count() - before, "collected": alive() is None,
                          "scanned": len(gc.get_objects())}}))
        el.close()
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(LOCAL_RANK="0"),
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["collected"], got  # frozen before the model existed, not after
    if freeze_gc:
        assert got["frozen"] > 50_000 and got["scanned"] < got["frozen"] // 10, got
    else:
        assert got["frozen"] == 0 and got["scanned"] > 50_000, got
