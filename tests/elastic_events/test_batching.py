"""Global-batch planner, loss normalisation and scale_config overrides."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_events.data.batching import (
    BatchPlan,
    BatchPlanError,
    global_mean_loss_factor,
    global_token_count,
    loss_scale,
    max_world_size,
    plan_global_batch,
    sum_in_batch_order,
)
from elastic_events.scale_config import (
    DEFAULT_SCHEMA,
    ScaleConfig,
    ScaleConfigError,
    load_scale_config,
    parse_scale_config,
)
from support.cluster import run_rank_scripts


def check_plan_invariants(plan: BatchPlan) -> None:
    g, w, m = plan.global_batch, plan.world_size, plan.micro_batch
    assert len(plan.samples_per_rank) == w
    assert sum(plan.samples_per_rank) == g
    assert set(plan.samples_per_rank) <= {g // w, -(-g // w)}
    assert plan.rank_offsets[0] == 0
    for r in range(w):
        sizes = plan.micro_batches(r)
        assert sum(sizes) == plan.samples_per_rank[r]
        assert all(0 < n <= m for n in sizes)
        assert len(sizes) == plan.accumulation_steps(r) == math.ceil(plan.samples_per_rank[r] / m)
        assert max(sizes, default=0) - min(sizes, default=0) <= 1
        sl = plan.rank_slice(r)
        assert (sl.start, sl.stop) == (plan.rank_offsets[r], plan.rank_offsets[r] + plan.samples_per_rank[r])
        if r + 1 < w:
            assert plan.rank_offsets[r + 1] == sl.stop
    assert plan.max_accumulation_steps == max(plan.accumulation_steps(r) for r in range(w))


@pytest.mark.parametrize(
    ("global_batch", "micro_batch", "world_size"),
    [(8, 2, 1), (8, 2, 4), (8, 8, 8), (7, 2, 3), (10, 3, 4), (128, 5, 24), (128, 128, 3), (1000, 7, 13), (5, 1, 5)],
)
def test_plan_invariants(global_batch: int, micro_batch: int, world_size: int) -> None:
    plan = plan_global_batch(global_batch=global_batch, micro_batch=micro_batch, world_size=world_size)
    check_plan_invariants(plan)
    assert plan.is_even == (global_batch % world_size == 0)


def test_128_over_24_ranks_with_micro_5() -> None:
    plan = plan_global_batch(global_batch=128, micro_batch=5, world_size=24, rank=3)
    assert plan.samples_per_rank == (6,) * 8 + (5,) * 16
    assert plan.rank_offsets[:3] == (0, 6, 12)
    assert plan.rank_offsets[8] == 48
    assert plan.rank_offsets[23] == 48 + 15 * 5
    assert plan.micro_batches() == [3, 3]  # rank 3 from the plan
    assert plan.micro_batches(8) == [5]
    assert plan.accumulation_steps(0) == 2
    assert plan.accumulation_steps(23) == 1
    assert plan.max_accumulation_steps == 2


@given(
    global_batch=st.integers(1, 300),
    micro_batch=st.integers(1, 40),
    world_size=st.integers(1, 300),
)
def test_plan_property(global_batch: int, micro_batch: int, world_size: int) -> None:
    if world_size > global_batch:
        with pytest.raises(BatchPlanError, match="world_size"):
            plan_global_batch(global_batch=global_batch, micro_batch=micro_batch, world_size=world_size)
        plan = plan_global_batch(
            global_batch=global_batch, micro_batch=micro_batch, world_size=world_size, allow_idle_ranks=True
        )
        assert plan.samples_per_rank.count(0) == world_size - global_batch
        assert plan.micro_batches(world_size - 1) == []
    else:
        plan = plan_global_batch(global_batch=global_batch, micro_batch=micro_batch, world_size=world_size)
    check_plan_invariants(plan)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"global_batch": 4, "micro_batch": 2, "world_size": 5}, r"world_size=5 exceeds global_batch=4.*at most 4"),
        ({"global_batch": 0, "micro_batch": 2, "world_size": 1}, r"global_batch must be positive, got 0"),
        ({"global_batch": 8, "micro_batch": -1, "world_size": 1}, r"micro_batch must be positive, got -1"),
        ({"global_batch": 8, "micro_batch": 2, "world_size": 0}, r"world_size must be positive, got 0"),
        ({"global_batch": 8.0, "micro_batch": 2, "world_size": 1}, r"global_batch must be an int, got float"),
        ({"global_batch": 8, "micro_batch": True, "world_size": 1}, r"micro_batch must be an int, got bool"),
        ({"global_batch": 8, "micro_batch": 2, "world_size": 2, "rank": 2}, r"rank must be in \[0, world_size=2\)"),
        ({"global_batch": 8, "micro_batch": 2, "world_size": 2, "rank": -1}, r"rank must be in \[0, world_size=2\)"),
    ],
)
def test_impossible_plans(kwargs: dict, pattern: str) -> None:
    with pytest.raises(BatchPlanError, match=pattern):
        plan_global_batch(**kwargs)


def test_plan_error_is_value_error_and_rank_is_required_when_absent() -> None:
    assert issubclass(BatchPlanError, ValueError)
    plan = plan_global_batch(global_batch=8, micro_batch=2, world_size=2)
    with pytest.raises(BatchPlanError, match="rank is required"):
        plan.micro_batches()
    with pytest.raises(BatchPlanError, match="rank must be in"):
        plan.accumulation_steps(2)


def test_max_world_size() -> None:
    assert max_world_size(128) == 128
    plan_global_batch(global_batch=128, micro_batch=1, world_size=max_world_size(128))
    with pytest.raises(BatchPlanError):
        plan_global_batch(global_batch=128, micro_batch=1, world_size=max_world_size(128) + 1)
    with pytest.raises(BatchPlanError, match="global_batch"):
        max_world_size(0)


# ------------------------------------------------------------------ loss scaling
def test_loss_scale_values() -> None:
    assert global_mean_loss_factor(4) == 4.0
    assert global_mean_loss_factor(4, grad_averaged=False) == 1.0
    assert loss_scale(3, 12, world_size=4) == pytest.approx(1.0)
    assert loss_scale(1, 10, world_size=5, grad_averaged=False) == pytest.approx(0.1)
    assert loss_scale(0, 10, world_size=5) == 0.0
    with pytest.raises(BatchPlanError, match="local_count=11 exceeds global_count=10"):
        loss_scale(11, 10, world_size=2)
    with pytest.raises(BatchPlanError, match="global_count must be positive"):
        loss_scale(1, 0, world_size=2)


@pytest.mark.parametrize("grad_averaged", [True, False])
@pytest.mark.parametrize(
    ("global_batch", "micro_batch", "world_size"), [(7, 2, 3), (128, 5, 24), (10, 4, 1), (9, 1, 4)]
)
def test_scaled_micro_batch_gradients_equal_global_mean(
    global_batch: int, micro_batch: int, world_size: int, grad_averaged: bool
) -> None:
    """Simulate DDP: per-rank accumulation of scaled micro-batch means, then average (or sum) over ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(global_batch, 3), torch.randn(global_batch, 1)

    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]

    plan = plan_global_batch(global_batch=global_batch, micro_batch=micro_batch, world_size=world_size)
    reduced = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(world_size):
        model.zero_grad()
        start = plan.rank_slice(rank).start
        for n in plan.micro_batches(rank):
            xb, yb = x[start : start + n], y[start : start + n]
            loss = torch.nn.functional.mse_loss(model(xb), yb)  # mean over the micro-batch
            (loss * loss_scale(n, global_batch, world_size=world_size, grad_averaged=grad_averaged)).backward()
            start += n
        for acc, p in zip(reduced, model.parameters()):
            acc += p.grad
    if grad_averaged:
        reduced = [g / world_size for g in reduced]
    for got, want in zip(reduced, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_global_token_count_without_process_group_is_local() -> None:
    assert not torch.distributed.is_initialized()
    assert global_token_count(17) == 17
    with pytest.raises(BatchPlanError, match="local_count"):
        global_token_count(-1)


# ------------------------------------------------------------------ deterministic reduction
SUM_WORKER = Path(__file__).resolve().parent / "workers" / "batch_order_sum.py"


def batch_order_worker():
    """The worker script as a module: its per-sample values and digest are what the ranks use."""
    spec = importlib.util.spec_from_file_location("batch_order_sum", SUM_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sum_in_batch_order_adds_along_the_pairwise_tree_in_one_process() -> None:
    worker = batch_order_worker()
    plan = plan_global_batch(global_batch=6, micro_batch=2, world_size=1, rank=0)
    v = [values[0] for values in worker.sample_values(6)]
    tree = ((v[0] + v[1]) + (v[2] + v[3])) + (v[4] + v[5])
    left_fold = ((((v[0] + v[1]) + v[2]) + v[3]) + v[4]) + v[5]
    assert not torch.equal(tree, left_fold)  # the data makes the order visible
    (total,) = sum_in_batch_order([[x.clone()] for x in v], plan, like=[v[0]])
    assert torch.equal(total, tree)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sum_in_batch_order_has_the_same_bits_at_every_world_size(world: int) -> None:
    """7 samples (uneven shares, not a power of two) over gloo ranks: every rank's sum is one process's, bit for bit."""
    worker = batch_order_worker()
    alone = sum_in_batch_order(
        worker.sample_values(7),
        plan_global_batch(global_batch=7, micro_batch=7, world_size=1, rank=0),
        like=worker.sample_values(1)[0],
    )
    assert [r["digest"] for r in run_rank_scripts(SUM_WORKER, world, "7")] == [worker.digest(alone)] * world


def test_sum_in_batch_order_rejects_values_that_do_not_match_the_plan() -> None:
    like = [torch.zeros(2)]
    plan = plan_global_batch(global_batch=4, micro_batch=2, world_size=1, rank=0)
    with pytest.raises(BatchPlanError, match="3 sample values for the 4 samples"):
        sum_in_batch_order([[torch.ones(2)]] * 3, plan, like=like)
    with pytest.raises(BatchPlanError, match="shaped like"):
        sum_in_batch_order([[torch.ones(3)]] * 4, plan, like=like)
    two = plan_global_batch(global_batch=4, micro_batch=2, world_size=2, rank=0)
    with pytest.raises(BatchPlanError, match="the plan is for 2 ranks, the group has 1"):
        sum_in_batch_order([[torch.ones(2)]] * 2, two, like=like)


# ------------------------------------------------------------------ scale_config
def test_scale_config_exact_and_fallback(tmp_path) -> None:
    path = tmp_path / "scale.yaml"
    path.write_text(
        "default: {micro_batch: 8, num_workers: 2}\n8: {micro_batch: 4}\n16: {micro_batch: 2, num_workers: 1}\n"
    )
    config = load_scale_config(path)
    assert config.world_sizes == (8, 16)
    assert config.resolve(8) == {"micro_batch": 4, "num_workers": 2}
    assert config.resolve(16) == {"micro_batch": 2, "num_workers": 1}
    assert config.resolve(12) == {"micro_batch": 4, "num_workers": 2}  # largest configured size below 12
    assert config.resolve(64) == {"micro_batch": 2, "num_workers": 1}
    assert config.resolve(4) == {"micro_batch": 8, "num_workers": 2}  # nothing smaller: default only
    with pytest.raises(ScaleConfigError, match=r"no entry for world size 12 \(configured: 8, 16\)"):
        config.resolve(12, exact=True)
    with pytest.raises(ScaleConfigError, match="world_size must be a positive int"):
        config.resolve(0)


def test_scale_config_json_with_string_keys_and_wrapper(tmp_path) -> None:
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"scale_config": {"2": {"lr": 1e-4}, "4": {"global_batch": 64, "lr": 2}}}))
    config = load_scale_config(path)
    assert config.resolve(4) == {"global_batch": 64, "lr": 2.0}
    assert config.resolve(3) == {"lr": 1e-4}
    assert config.resolve(1) == {}


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("8: {micro_batchh: 4}\n", r"scale.yaml: world size 8: unknown key 'micro_batchh' \(known: "),
        ("8: {micro_batch: 0}\n", r"scale.yaml: world size 8: micro_batch must be a positive int, got 0"),
        ("8: {micro_batch: true}\n", r"world size 8: micro_batch must be a positive int, got True"),
        ("8: {lr: -1}\n", r"world size 8: lr must be a positive finite number, got -1"),
        ("default: {num_workers: -2}\n", r"scale.yaml: default: num_workers must be a non-negative int"),
        ("0: {micro_batch: 2}\n", r"world size 0 must be a positive int"),
        ("eight: {micro_batch: 2}\n", r"key 'eight' is neither a world size nor 'default'"),
        ("8: 4\n", r"world size 8: overrides must be a mapping, got int"),
        ("- 8\n", r"expected a mapping of world size to overrides, got list"),
        ("8: {micro_batch: 2}\n'8': {micro_batch: 3}\n", r"world size 8 appears twice"),
        ("8: [unclosed\n", r"scale.yaml: not valid YAML"),
    ],
)
def test_scale_config_errors_name_file_and_field(tmp_path, text: str, pattern: str) -> None:
    path = tmp_path / "scale.yaml"
    path.write_text(text)
    with pytest.raises(ScaleConfigError, match=pattern):
        load_scale_config(path)


def test_scale_config_missing_file_and_custom_schema(tmp_path) -> None:
    with pytest.raises(ScaleConfigError, match="nope.yaml: cannot read scale config"):
        load_scale_config(tmp_path / "nope.yaml")
    schema = {**DEFAULT_SCHEMA, "tp_degree": DEFAULT_SCHEMA["micro_batch"]}
    config = parse_scale_config({4: {"tp_degree": 2}}, schema=schema)
    assert config.resolve(5) == {"tp_degree": 2}
    with pytest.raises(ScaleConfigError, match="unknown key 'tp_degree'"):
        ScaleConfig(by_world_size={4: {"tp_degree": 2}})
