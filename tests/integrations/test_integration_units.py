"""Pure parts of the framework integrations: global batch planning, markers, the elastic order, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_events.integrations.common import (
    ElasticIntegrationError,
    GlobalBatchError,
    ResumeMarker,
    accumulation_steps,
    newest_marked,
    read_marker,
    write_marker,
)
from support.launch import clean_env


@pytest.mark.parametrize(("world", "steps"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_accumulation_keeps_the_global_batch(world: int, steps: int) -> None:
    assert accumulation_steps(global_batch=64, per_device_batch=8, world_size=world) == steps


def test_accumulation_names_the_sizes_that_cannot_keep_it() -> None:
    with pytest.raises(GlobalBatchError) as info:
        accumulation_steps(global_batch=64, per_device_batch=8, world_size=2, world_sizes=range(1, 7))
    message = str(info.value)
    assert "cannot be kept at world size 3, 5, 6" in message
    assert "world sizes up to 6 that keep it: 1, 2, 4" in message


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_accumulation_rejects_non_positive_ints(bad) -> None:
    with pytest.raises(GlobalBatchError, match="global_batch must be a positive int"):
        accumulation_steps(global_batch=bad, per_device_batch=8, world_size=1)


def test_newest_complete_checkpoint_skips_unmarked_ones(tmp_path) -> None:
    for step in (5, 10, 40):
        (tmp_path / f"checkpoint-{step}").mkdir()
    marker = ResumeMarker(step=10, world_size=2, global_batch=8, seed=0)
    for step in (5, 10):
        write_marker(tmp_path / f"checkpoint-{step}" / "elastic.json", marker)
    # checkpoint-40 has no marker: a save cut short
    assert newest_marked(tmp_path, r"checkpoint-(\d+)", "{name}/elastic.json") == tmp_path / "checkpoint-10"
    assert read_marker(tmp_path / "checkpoint-10" / "elastic.json") == marker
    assert read_marker(tmp_path / "checkpoint-40" / "elastic.json") is None
    assert newest_marked(tmp_path / "missing", r"checkpoint-(\d+)", "{name}/elastic.json") is None


def test_malformed_marker_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "elastic.json"
    path.write_text('{"step": 1}')
    with pytest.raises(ElasticIntegrationError, match="elastic.json is malformed"):
        read_marker(path)


def test_hf_elastic_order_is_the_same_global_order_at_every_world_size() -> None:
    from elastic_events.data.sampler import epoch_permutation
    from elastic_events.integrations.transformers import ElasticOrderSampler

    sampler = ElasticOrderSampler(50, global_batch=8, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    assert len(order) == len(sampler) == 48  # the tail of 2 is not a whole global batch
    assert order == epoch_permutation(50, seed=3, epoch=2)[:48].tolist()
    # accelerate deals batches round-robin: step s of any world size trains order[s*8:(s+1)*8]
    for world, per_device in ((1, 2), (2, 2), (4, 2)):
        batches = [order[i : i + per_device] for i in range(0, len(order), per_device)]
        accumulation = 8 // (per_device * world)
        for step in range(6):
            ranks = [batches[rank::world][step * accumulation : (step + 1) * accumulation] for rank in range(world)]
            assert sorted(i for r in ranks for b in r for i in b) == sorted(order[step * 8 : (step + 1) * 8])


def test_importing_elastic_events_imports_no_framework() -> None:
    code = (
        "import sys, elastic_events, elastic_events.integrations, elastic_events.integrations.common\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
