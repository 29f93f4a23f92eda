"""Simulated nodes on one host get GPUs of their own, or all train on the CPU: never a shared cuda:0."""

from __future__ import annotations

import pytest

from hyperpodrun.device_plan import DevicePlan


def test_each_slot_gets_its_own_gpus_when_every_slot_fits() -> None:
    plan = DevicePlan(slots=3, nproc=2, gpus=8)
    assert plan.on_gpus and plan.note() is None
    assert [plan.env(i)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0,1", "2,3", "4,5"]


def test_too_few_gpus_puts_every_node_on_the_cpu_with_one_line() -> None:
    plan = DevicePlan(slots=3, nproc=1, gpus=2)  # two nodes would fit, the third would not: one backend for all
    assert [plan.env(i) for i in range(3)] == [{"CUDA_VISIBLE_DEVICES": ""}] * 3
    assert plan.note() == (
        "2 GPU(s) on this host for 3 simulated node(s) x 1 rank(s): one GPU per rank does not fit, "
        "every node trains on the CPU (gloo)"
    )


def test_a_host_without_gpus_changes_nothing() -> None:
    plan = DevicePlan(slots=2, nproc=4, gpus=0)
    assert plan.env(1) == {} and plan.note() is None


def test_a_slot_outside_the_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 2 is outside 0..1"):
        DevicePlan(slots=2, nproc=1, gpus=2).env(2)
