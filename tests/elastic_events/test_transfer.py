"""Chunked transfer: the bucket plan (pure) and a real two-rank gloo broadcast of mixed tensors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from elastic_events.rounds.transfer import plan_buckets
from support.cluster import run_rank_scripts

WORKER = Path(__file__).resolve().parent / "workers" / "transfer_check.py"


def covered(sizes: list[int], bucket: int) -> dict[int, list[tuple[int, int]]]:
    spans: dict[int, list[tuple[int, int]]] = {}
    for b in plan_buckets(sizes, bucket):
        assert 0 < b.nbytes <= bucket
        if b.direct:
            assert len(b.pieces) == 1 and sizes[b.pieces[0].index] >= bucket
        offsets = [p.offset for p in b.pieces]
        assert offsets == sorted(offsets) and all(p.offset + p.length <= bucket for p in b.pieces)
        for p in b.pieces:
            spans.setdefault(p.index, []).append((p.start, p.start + p.length))
    return spans


def test_plan_packs_small_tensors_and_slices_large_ones() -> None:
    plan = plan_buckets([10, 250, 60, 30, 100, 0, 45], 100)
    shapes = [(b.direct, [(p.index, p.start, p.length, p.offset) for p in b.pieces]) for b in plan]
    assert shapes == [
        (True, [(1, 0, 100, 0)]),
        (True, [(1, 100, 100, 0)]),
        (True, [(1, 200, 50, 0)]),
        (True, [(4, 0, 100, 0)]),
        (False, [(0, 0, 10, 0), (2, 0, 60, 10), (3, 0, 30, 70)]),
        (False, [(6, 0, 45, 0)]),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_plan_moves_every_byte_once_within_the_bucket(seed: int) -> None:
    rng = random.Random(seed)
    bucket = rng.randint(1, 64)
    sizes = [rng.choice([0, 1, rng.randint(1, 200)]) for _ in range(rng.randint(0, 30))]
    spans = covered(sizes, bucket)
    for index, size in enumerate(sizes):
        ends = [0]
        for start, end in sorted(spans.get(index, [])):
            assert start == ends[-1], f"tensor {index}: bytes {ends[-1]}..{start} missed or sent twice"
            ends.append(end)
        assert ends[-1] == size


def test_plan_rejects_an_empty_bucket() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets([1], 0)


@pytest.mark.parametrize("world", [2, 3])
def test_receivers_get_every_tensor_bitwise_with_one_bucket_of_staging(world: int) -> None:
    bucket = 256
    results = run_rank_scripts(WORKER, world, str(bucket))
    assert all(r["same"] for r in results), results
    nbytes = 15 * 4 + 7 * 2 + 4 * 8 + 9 + 8 + 24 * 4 + 1000 * 4 + 0 + 6 * 2
    assert {r["nbytes"] for r in results} == {nbytes}
    assert {r["staging"] for r in results} <= set(range(1, bucket + 1))
    assert {r["broadcasts"] for r in results} == {len(plan_buckets([60, 14, 32, 9, 8, 96, 4000, 0, 12], bucket))}


def test_pinned_bytes_are_exactly_what_was_asked_and_unpinned_when_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA, host memory for snapshot copies is registered with the driver at its exact size (the
    caching host allocator would round 2.09 GB up to 4 GB and keep it) and unregistered once freed."""
    import gc

    from torch.cuda import _pin_memory_utils

    from elastic_events.rounds import transfer

    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_pin_memory_utils, "pin_memory", lambda ptr, size: calls.append(("pin", ptr, size)))
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory", lambda ptr: calls.append(("unpin", ptr, 0)))
    flat = transfer.pinned_empty(3_000_001)
    ptr = flat.data_ptr()
    assert flat.numel() == 3_000_001 and calls == [("pin", ptr, 3_000_001)]
    del flat
    gc.collect()
    assert calls == [("pin", ptr, 3_000_001), ("unpin", ptr, 0)]
