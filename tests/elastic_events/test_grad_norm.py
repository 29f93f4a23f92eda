"""``elastic_events.clip_grad_norm_``: the global norm of gradients that are DTensors (HSDP, FSDP) summed from the
ranks' local shards, on real gloo ranks, against torch's clip of the same gradients in one process."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_events import clip_grad_norm_
from support.launch import clean_env
from support.ports import free_port

WORKERS = Path(__file__).resolve().parent / "workers"
SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(WORKERS))
from grad_norm_ranks import CLIPS, full_tensors  # noqa: E402


def clipped_by_ranks(tmp_path: Path, *, world: int, replicas: int) -> list[list[dict]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / "grad_norm_ranks.py"),
                *(str(a) for a in (rank, world, port, replicas, tmp_path / f"{rank}.pt")),
            ],
            env=clean_env(PYTHONPATH=str(SRC)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, [e[-2000:] for e in errors]
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]


def clipped_in_one_process(norm_type: float, max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [torch.nn.Parameter(v) for v in full_tensors(0)]
    for p, g in zip(params, full_tensors(1), strict=True):
        p.grad = g
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize(
    ("world", "replicas"),
    [
        (4, 2),  # HSDP 2 x 2: each shard counted once, on replica 0's ranks only
        (3, 1),  # FSDP over 3 ranks: 5 rows split 2, 2, 1; the 1 x 4 tensor on rank 0, empty on the others
    ],
)
def test_the_norm_and_the_clipped_gradients_are_one_processs(tmp_path: Path, world: int, replicas: int) -> None:
    results = clipped_by_ranks(tmp_path, world=world, replicas=replicas)
    for (norm_type, max_norm), *got in zip(CLIPS, *results, strict=True):
        want_norm, want_grads = clipped_in_one_process(norm_type, max_norm)
        for rank, clip in enumerate(got):
            where = f"rank {rank}, norm {norm_type}"
            assert clip["type"] == "Tensor" and clip["norm"].dtype == torch.float64, where
            torch.testing.assert_close(clip["norm"], want_norm, rtol=1e-13, atol=0, msg=f"{where}: total norm")
            for i, (g, w) in enumerate(zip(clip["grads"], want_grads, strict=True)):
                torch.testing.assert_close(g, w, rtol=1e-13, atol=0, msg=f"{where}: gradient {i}")
            assert clip["computed"] == 0, f"{where}: the clip computed {clip['computed']} DTensor shardings"
            clipped = max_norm < float(want_norm)
            assert torch.equal(clip["grads"][0], full_tensors(1)[0]) is not clipped, where


def test_plain_gradients_are_clipped_as_torch_clips_them() -> None:
    params = [torch.nn.Parameter(v) for v in full_tensors(0)]
    for p, g in zip(params, full_tensors(1), strict=True):
        p.grad = g.clone()
    norm = clip_grad_norm_(params, 1.0)
    want_norm, want_grads = clipped_in_one_process(2.0, 1.0)
    assert torch.equal(norm, want_norm) and all(torch.equal(p.grad, w) for p, w in zip(params, want_grads))
    no_grad = torch.nn.Parameter(torch.ones(3))
    assert float(clip_grad_norm_([no_grad], 1.0)) == 0.0 and no_grad.grad is None


def test_a_non_finite_norm_raises_when_asked_and_bad_arguments_raise() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, math.nan])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, 2.0, True, False)  # torch's positional order, foreach last
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm_([p], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_([p], 1.0, norm_type=0)
