"""ElasticSampler: global state, exactly-once over world-size changes, torchdata interplay."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from elastic_events.contract import rank_context
from elastic_events.data.sampler import (
    ElasticSampler,
    SamplerConfigError,
    SamplerStateError,
    SamplerUsageError,
    epoch_permutation,
)


class IndexDataset(torch.utils.data.Dataset):
    """Sample i is the tensor i, so collated micro-batches are the sampled indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def make(n: int, world: int, rank: int, *, g: int = 6, m: int = 2, **kwargs) -> ElasticSampler:
    return ElasticSampler(n, global_batch=g, micro_batch=m, rank=rank, world_size=world, **kwargs)


def run_phase(state: dict | None, *, n: int, world: int, steps: int, g: int, m: int, seed: int, drop_last: bool):
    """Every rank of one phase trains ``steps`` steps (or to the epoch's end) from ``state``.

    Returns the state every rank would save (asserted equal) and, per global batch,
    the indices each rank trained on.
    """
    states, batches = [], {}
    for rank in range(world):
        sampler = ElasticSampler(
            n, global_batch=g, micro_batch=m, rank=rank, world_size=world, seed=seed, drop_last=drop_last
        )
        if state is not None:
            sampler.load_state_dict(state)
        epoch = sampler.epoch
        for taken, step in enumerate(sampler.steps(sampler)):  # the sampler itself yields index lists
            if taken == steps:
                break
            assert [len(mb) for mb in step.micro_batches] == step.micro_batch_sizes
            assert all(len(mb) <= m for mb in step.micro_batches)
            batches.setdefault((step.epoch, step.start), {})[rank] = [i for mb in step.micro_batches for i in mb]
            sampler.mark_step()
        assert sampler.epoch in (epoch, epoch + 1)
        states.append(sampler.state_dict())
    assert all(s == states[0] for s in states), states
    return states[0], batches


def check_steps_partition(batches: dict, *, n: int, seed: int, g: int, world: int) -> list[int]:
    """Every rank has a share of each step; the shares, in rank order, are exactly the global batch."""
    trained = []
    for (epoch, start), by_rank in sorted(batches.items()):
        perm = epoch_permutation(n, seed=seed, epoch=epoch).tolist()
        assert sorted(by_rank) == list(range(world))
        joined = [i for r in range(world) for i in by_rank[r]]
        assert joined == perm[start : start + min(g, n - start)]
        trained += joined
    return trained


# ----------------------------------------------------------------------- basics
def test_rank_slices_partition_each_global_batch() -> None:
    n, g, world = 40, 7, 3
    state, batches = run_phase(None, n=n, world=world, steps=99, g=g, m=2, seed=5, drop_last=True)
    assert (state["epoch"], state["consumed"]) == (1, 0)
    assert sorted(batches) == [(0, k * g) for k in range(n // g)]
    for by_rank in batches.values():
        assert [len(by_rank[r]) for r in range(world)] == [3, 2, 2]
    trained = check_steps_partition(batches, n=n, seed=5, g=g, world=world)
    assert len(trained) == len(set(trained)) == (n // g) * g


def test_shuffle_false_is_dataset_order_and_seed_changes_order() -> None:
    s = make(12, 1, 0, g=4, m=4, shuffle=False)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    first = epoch_permutation(100, seed=1, epoch=0)
    assert sorted(first.tolist()) == list(range(100))
    assert not torch.equal(first, epoch_permutation(100, seed=1, epoch=1))
    assert torch.equal(epoch_permutation(100, seed=1, epoch=1), epoch_permutation(100, seed=2, epoch=0))


def test_state_round_trip_and_world_independence() -> None:
    s = make(30, 2, 0, g=6, seed=9)
    steps = s.steps(s)
    for _ in range(2):
        next(steps)
        s.mark_step()
    state = s.state_dict()
    assert state == {"version": 1, "seed": 9, "epoch": 0, "consumed": 12, "num_samples": 30, "shuffle": True}
    other = make(30, 3, 2, g=6, seed=0, m=1)  # another world, rank, micro-batch and constructor seed
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert (other.seed, other.epoch, other.consumed) == (9, 0, 12)
    perm = epoch_permutation(30, seed=9, epoch=0).tolist()
    assert next(iter(other)) == perm[12 + 4 : 12 + 5]  # rank 2 of 3 owns positions 4-5 of the batch at 12


def test_len_counts_micro_batches_from_trained_position() -> None:
    s = make(23, 2, 1, g=5, m=2)  # rank 1 takes 2 of every 5: one micro-batch per step, 4 steps
    assert len(s) == 4 == len(list(s))
    assert s.remaining_steps == 4
    s2 = make(23, 2, 0, g=5, m=2, drop_last=False)  # rank 0 takes 3 -> [2, 1]; tail of 3 -> rank 0 takes 2
    assert len(s2) == 4 * 2 + 1 == len(list(s2))
    assert s2.remaining_steps == 5


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_samples": 0}, "num_samples must be >= 1"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"world_size": 9, "global_batch": 8}, "world_size=9 exceeds global_batch=8"),
        ({"micro_batch": 0}, "micro_batch must be positive"),
        ({"num_samples": 5, "global_batch": 8}, "global_batch=8 exceeds num_samples=5"),
        ({"rank": 4, "world_size": 4}, r"rank must be in \[0, world_size=4\)"),
    ],
)
def test_invalid_configuration(kwargs: dict, pattern: str) -> None:
    args = {"num_samples": 50, "global_batch": 8, "micro_batch": 2, "rank": 0, "world_size": 2} | kwargs
    with pytest.raises(SamplerConfigError, match=pattern):
        ElasticSampler(args.pop("num_samples"), **args)


def test_without_a_process_group_rank_and_world_come_from_the_launchers_environment(monkeypatch) -> None:
    """Before ElasticTraining has joined the group (which splits the sampler again), the sampler takes the
    round the launcher started the process in; a plain script is rank 0 of 1."""
    assert (
        ElasticSampler(10, global_batch=2, micro_batch=1).plan.rank,
        ElasticSampler(10, global_batch=2, micro_batch=1).plan.world_size,
    ) == (0, 1)
    for name, value in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    rank_context.cache_clear()
    plan = ElasticSampler(12, global_batch=6, micro_batch=1).plan
    assert (plan.rank, plan.world_size) == (2, 3)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"num_samples": 31}, "num_samples=31 does not match this sampler's num_samples=30"),
        ({"shuffle": False}, "shuffle=False does not match"),
        ({"version": 2}, "version 2 is not 1"),
        ({"consumed": 31}, "consumed=31 exceeds num_samples=30"),
        ({"epoch": -1}, "epoch must be a non-negative int"),
        ({"seed": "1"}, "seed must be a non-negative int"),
        ({"shuffle": 1}, "shuffle must be a bool"),
    ],
)
def test_bad_state_is_rejected(change: dict, pattern: str) -> None:
    state = make(30, 1, 0).state_dict() | change
    with pytest.raises(SamplerStateError, match=pattern):
        make(30, 2, 1).load_state_dict(state)


def test_missing_state_fields_are_named() -> None:
    with pytest.raises(SamplerStateError, match="lacks consumed, epoch"):
        make(30, 1, 0).load_state_dict({"version": 1, "seed": 0, "num_samples": 30, "shuffle": True})


# ------------------------------------------------------------ trained position
def test_mark_step_needs_the_step_drawn_and_rolls_the_epoch() -> None:
    s = make(13, 2, 0, g=6, m=3)  # two steps per epoch, one dropped sample
    with pytest.raises(SamplerUsageError, match="has drawn its micro-batches only up to epoch 0 position 0"):
        s.mark_step()
    it = iter(s)
    next(it)
    s.mark_step()
    assert (s.epoch, s.consumed) == (0, 6)
    with pytest.raises(SamplerUsageError):
        s.mark_step()  # the second step is not drawn yet
    next(it)
    s.mark_step()
    assert (s.epoch, s.consumed) == (1, 0)  # position 12 of 13 is the dropped tail: next epoch
    with pytest.raises(StopIteration):
        next(it)
    perm1 = epoch_permutation(13, seed=0, epoch=1).tolist()
    assert next(iter(s)) == perm1[0:3]


def test_steps_requires_one_mark_step_per_step() -> None:
    s = make(24, 2, 0, g=6, m=2)
    steps = s.steps(s)
    next(steps)
    with pytest.raises(SamplerUsageError, match="call mark_step\\(\\) exactly once per step"):
        next(steps)


def test_steps_detects_a_loader_not_driven_by_the_sampler() -> None:
    s = make(24, 2, 0, g=6, m=2)
    with pytest.raises(SamplerUsageError, match="loader ended after 1 of 2 micro-batches"):
        next(s.steps([[0, 1]]))
    steps = s.steps([*s, [98], [99]])  # iterating the sampler draws the whole epoch
    for _ in range(4):
        next(steps)
        s.mark_step()
    with pytest.raises(SamplerUsageError, match="yielded more micro-batches than the sampler planned"):
        next(steps)


def test_loading_state_invalidates_running_iterators() -> None:
    s = make(24, 2, 0, g=6, m=2)
    it = iter(s)
    next(it)
    s.load_state_dict(s.state_dict())
    with pytest.raises(SamplerUsageError, match="state was loaded while this iterator was running"):
        next(it)


def test_set_world_keeps_the_position_and_splits_the_next_batches_over_the_new_world() -> None:
    s = make(24, 2, 1, g=6, m=3)
    it = iter(s)
    next(it)
    s.mark_step()
    s.set_world(rank=2, world_size=3)
    assert (s.rank, s.world_size, s.consumed, s.plan.micro_batches()) == (2, 3, 6, [2])
    assert next(iter(s)) == epoch_permutation(24, seed=0, epoch=0)[10:12].tolist()
    with pytest.raises(SamplerUsageError, match="state was loaded while this iterator was running"):
        next(it)
    with pytest.raises(SamplerConfigError, match="rank"):
        s.set_world(rank=3, world_size=3)


def test_epochs_roll_over_with_exactly_once_per_epoch() -> None:
    n, g, world = 20, 6, 2  # 3 steps per epoch, 2 samples dropped
    state, seen = None, Counter()
    for _ in range(3):  # three epochs, each in one phase
        state, batches = run_phase(state, n=n, world=world, steps=99, g=g, m=2, seed=4, drop_last=True)
        for (epoch, _start), by_rank in batches.items():
            seen.update((epoch, i) for ids in by_rank.values() for i in ids)
    assert state["epoch"] == 3 and state["consumed"] == 0
    for epoch in range(3):
        perm = epoch_permutation(n, seed=4, epoch=epoch).tolist()
        assert {i for (e, i) in seen if e == epoch} == set(perm[:18])
    assert set(seen.values()) == {1}


# ------------------------------------------------------------- property: exactly once
@st.composite
def schedules(draw):
    n = draw(st.integers(1, 60))
    drop_last = draw(st.booleans())
    g = draw(st.integers(1, n if drop_last else n + 3))
    phases = draw(
        st.lists(st.tuples(st.integers(1, min(g, 8)), st.integers(0, 4), st.integers(1, 5)), min_size=0, max_size=5)
    )
    final = (draw(st.integers(1, min(g, 8))), 10_000, draw(st.integers(1, 5)))
    return n, g, drop_last, draw(st.integers(0, 2**16)), [*phases, final]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_any_world_size_schedule_trains_every_sample_exactly_once(case) -> None:
    n, g, drop_last, seed, phases = case
    state, seen = None, []
    for world, steps, m in phases:
        if state is not None and state["epoch"] == 1:
            break  # epoch 0 is complete
        state, batches = run_phase(state, n=n, world=world, steps=steps, g=g, m=m, seed=seed, drop_last=drop_last)
        seen += check_steps_partition(batches, n=n, seed=seed, g=g, world=world)
    assert (state["epoch"], state["consumed"]) == (1, 0)
    counts = Counter(seen)
    assert set(counts.values()) <= {1}, "a sample was trained twice"
    perm = epoch_permutation(n, seed=seed, epoch=0).tolist()
    end = n - n % g if drop_last else n
    assert set(counts) == set(perm[:end])
    assert set(range(n)) - set(counts) == set(perm[end:])  # exactly the dropped tail is missing


# --------------------------------------------------------- StatefulDataLoader
LOADER_KW = {"num_workers": 2, "prefetch_factor": 2, "multiprocessing_context": "fork"}


def test_prefetching_loader_does_not_move_the_trained_position() -> None:
    n, g, m = 40, 6, 1
    s = make(n, 2, 0, g=g, m=m, seed=1)
    loader = StatefulDataLoader(IndexDataset(n), batch_sampler=s, **LOADER_KW)
    steps = s.steps(loader)
    for k in range(2):
        step = next(steps)
        assert s.drawn > (0, (k + 1) * g)  # the loader has read ahead of the step being trained
        assert s.state_dict()["consumed"] == k * g
        s.mark_step()
    assert s.state_dict()["consumed"] == 2 * g
    steps.close()
    perm = epoch_permutation(n, seed=1, epoch=0).tolist()
    assert step.micro_batches[0].tolist() == perm[g : g + 1]


@pytest.mark.parametrize("route", ["sampler_state", "loader_state"])
def test_loader_resume_across_world_sizes_is_exactly_once(route: str) -> None:
    """Ranks simulated in one process: 2 ranks for 2 steps, then 3 ranks to the end of the epoch."""
    n, g, m, seed = 41, 6, 2, 3
    seen: list[int] = []
    saved = {}
    for rank in range(2):
        s = make(n, 2, rank, g=g, m=m, seed=seed)
        loader = StatefulDataLoader(IndexDataset(n), batch_sampler=s, **LOADER_KW)
        for k, step in enumerate(s.steps(loader)):
            seen += [i for mb in step.micro_batches for i in mb.tolist()]
            s.mark_step()
            if k == 1:
                break
        saved[rank] = s.state_dict() if route == "sampler_state" else loader.state_dict()
    for rank in range(3):
        s = make(n, 3, rank, g=g, m=m, seed=seed)
        loader = StatefulDataLoader(IndexDataset(n), batch_sampler=s, **LOADER_KW)
        if route == "sampler_state":
            s.load_state_dict(saved[0])
        else:
            loader.load_state_dict(saved[0])
        for step in s.steps(loader):
            assert step.start >= 2 * g
            seen += [i for mb in step.micro_batches for i in mb.tolist()]
            s.mark_step()
        assert (s.epoch, s.consumed) == (1, 0)
    perm = epoch_permutation(n, seed=seed, epoch=0).tolist()
    assert sorted(seen) == sorted(perm[: n - n % g])


class PidDataset(torch.utils.data.Dataset):
    """Sample i is the row (i, pid of the process that loaded it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


def test_a_resize_in_place_keeps_the_loader_workers_and_drops_their_read_ahead() -> None:
    """An in-place resize re-splits the sampler under a persistent-worker loader: the next steps come from
    the same worker processes, and none of the batches they had read ahead for the old split is trained."""
    n, g, m, seed = 60, 6, 1, 5
    s = make(n, 2, 0, g=g, m=m, seed=seed)
    loader = StatefulDataLoader(PidDataset(n), batch_sampler=s, persistent_workers=True, **LOADER_KW)
    steps = s.steps(loader)
    before: list[torch.Tensor] = []
    for k in range(2):
        step = next(steps)
        assert s.drawn > (0, (k + 1) * g)  # the workers have read ahead of the trained step
        before += step.micro_batches
        s.mark_step()
    steps.close()
    s.set_world(rank=1, world_size=3)  # what ElasticTraining does in a round; steps() then iterates again
    after = []
    for k, step in enumerate(s.steps(loader)):
        after += step.micro_batches
        s.mark_step()
        if k == 2:
            break
    perm = epoch_permutation(n, seed=seed, epoch=0).tolist()
    assert [int(mb[0, 0]) for mb in before] == [perm[start + i] for start in (0, g) for i in (0, 1, 2)]  # rank 0 of 2
    # rank 1 of 3 from the trained position: samples 2..3 of each global batch, micro-batches of one
    assert [int(mb[0, 0]) for mb in after] == [perm[start + i] for start in (2 * g, 3 * g, 4 * g) for i in (2, 3)]
    workers = {int(mb[0, 1]) for mb in before}
    assert os.getpid() not in workers and len(workers) >= 1
    assert {int(mb[0, 1]) for mb in after} <= workers, "the loader started new worker processes after the resize"


def test_loader_state_saved_mid_step_is_refused() -> None:
    s = make(30, 1, 0, g=6, m=2)
    loader = StatefulDataLoader(IndexDataset(30), batch_sampler=s, num_workers=0)
    it = iter(loader)
    next(it)  # one of three micro-batches of the first step
    state = loader.state_dict()
    fresh = make(30, 1, 0, g=6, m=2)
    restored = StatefulDataLoader(IndexDataset(30), batch_sampler=fresh, num_workers=0)
    restored.load_state_dict(state)
    with pytest.raises(SamplerStateError, match="saved in the middle of a global batch"):
        iter(restored)
