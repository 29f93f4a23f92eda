"""The full state of a model sharded over the world, gathered onto one rank and scattered back by rows: the split
and the bucket plan (pure), and real gloo ranks against ``full_tensor()`` and the state they started from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from elastic_events.rounds.full_gather import ALIGN, ALONE_FROM, bucket_size, plan_gather, row_ranges
from support.cluster import run_rank_scripts

WORKER = Path(__file__).resolve().parent / "workers" / "full_state_check.py"


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 8, 9, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_split_as_torch_chunk_splits_them(rows: int, world: int) -> None:
    chunks = torch.arange(rows).chunk(world) if rows else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    got = row_ranges(rows, world)
    assert len(got) == world
    assert [r for r in got if r[1] > r[0]] == expected
    assert all(start == end for start, end in got[len(expected) :])  # the short tail: empty shares


def test_row_ranges_refuse_an_empty_world() -> None:
    with pytest.raises(ValueError, match="world >= 1"):
        row_ranges(4, 0)


@pytest.mark.parametrize("seed", range(10))
def test_buckets_hold_every_tensor_once_within_their_bound(seed: int) -> None:
    rng = random.Random(seed)
    world, bucket = rng.randint(1, 5), rng.randint(1, 400)
    shapes = [((rng.randint(0, 12), rng.randint(1, 4)), rng.choice([1, 2, 4, 8])) for _ in range(rng.randint(1, 20))]
    plan = plan_gather(shapes, world, bucket)
    assert [slot.index for b in plan for slot in b] == list(range(len(shapes)))
    for b in plan:
        offsets = [slot.offset for slot in b]
        assert offsets == sorted(offsets) and offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets)
        assert all(0 <= z.offset - (a.offset + a.room) < ALIGN for a, z in zip(b, b[1:]))  # packed, aligned
        assert bucket_size(b) == b[-1].offset + b[-1].room
        assert bucket_size(b) <= bucket or len(b) == 1  # a larger share goes alone
        assert len(b) == 1 or all(slot.room < min(bucket, ALONE_FROM) for slot in b)  # and so does a large one
    for slot in (s for b in plan for s in b):
        (rows, cols), itemsize = shapes[slot.index]
        assert slot.row_bytes == cols * itemsize and slot.rows == tuple(row_ranges(rows, world))


def test_plan_refuses_an_empty_bucket() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_gather([((2, 2), 4)], 2, 0)


# 16 bytes: a bucket per tensor (each larger than the bound); 1 MiB: one bucket for all
WORLDS_AND_BUCKETS = {"3-ranks": (3, 16), "4-ranks": (4, 1 << 20)}


@pytest.fixture(scope="module", params=sorted(WORLDS_AND_BUCKETS))
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    """Every rank's results of the gather and the three scatter cases, run once per world in one process group."""
    world, bucket = WORLDS_AND_BUCKETS[request.param]
    return run_rank_scripts(WORKER, world, str(bucket))


def test_the_holder_gets_the_full_state_bitwise_and_the_others_nothing(ranks: list[dict]) -> None:
    results = [r["gather"] for r in ranks]
    holder = results[-1]
    assert holder["model_same"] and holder["optimizer_same"], holder
    assert holder["tensors"] == 9 and holder["moments"] == ["exp_avg", "exp_avg_sq", "step"]
    # every parameter but module 4's weight (split by columns) is split by rows; the buffer is not a DTensor
    assert {r["by_rows"] for r in results} == {7}
    assert all(r["nothing"] for r in results[:-1]), results


def test_rank_0s_full_state_scattered_by_rows_is_the_state_bitwise(ranks: list[dict]) -> None:
    results = [r["rows"] for r in ranks]
    assert all(r["loaded"] for r in results), results
    assert {r["twin_state"] for r in results} == {8}  # AdamW state for every parameter, on every rank
    first = results[0]
    assert first["model_same"] and first["optimizer_same"] and first["next_step_same"], first
    assert first["lrs"] == pytest.approx([0.1 / 4, 0.05 / 4])  # the saved groups' rates, then a third step


@pytest.mark.parametrize("case", ["columns", "reordered"])
def test_a_layout_or_an_order_the_rows_path_cannot_map_is_refused_on_every_rank(ranks: list[dict], case: str) -> None:
    results = [r[case] for r in ranks]
    assert [r["loaded"] for r in results] == [False] * len(ranks), results
    assert {r["twin_state"] for r in results} == {0}  # nothing was loaded: DCP's path takes over
