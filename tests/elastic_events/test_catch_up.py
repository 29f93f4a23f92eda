"""A joiner's copy of step s, stepped through the survivors' step records, equals the survivors' state at s + k."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from elastic_events.rounds.catch_up import CatchUpError, DeltaLog, EntryKind, StepDelta, plan_entry, replay

OptimizerFn = Callable[[list[dict]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFn] = {
    "sgd-nesterov-wd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw-amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, weight_decay=0.1),
}


class Net(torch.nn.Module):
    """Two layers and a branch used on odd steps only: its parameters have no gradient on even steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.branch = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.branch(h) if step % 2 else 0)


class Trainer:
    """A model, its optimizer over two groups (the head at a rate of its own), a warm-up schedule, and
    gradient clipping: what a step applies depends on the step's data, the clip and the schedule."""

    def __init__(self, optimizer_fn: OptimizerFn) -> None:
        self.model = Net()
        self.optimizer = optimizer_fn(
            [
                {"params": [*self.model.body.parameters(), *self.model.branch.parameters()]},
                {"params": list(self.model.head.parameters()), "lr": 1e-3},
            ]
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 4))
        self.step = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(self.step)
            x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
            torch.nn.functional.mse_loss(self.model(x, self.step + 1), y).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1

    def copy(self, optimizer_fn: OptimizerFn) -> Trainer:
        """What a joiner holds after the background copy: the model's and the optimizer's state at this step."""
        joiner = Trainer(optimizer_fn)
        joiner.model.load_state_dict(copy.deepcopy(self.model.state_dict()))
        joiner.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
        joiner.step = self.step
        return joiner


def state_tensors(trainer: Trainer) -> list[torch.Tensor]:
    opt_state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [*(p.detach() for p in trainer.model.parameters()), *opt_state]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("behind", [1, 5])
def test_a_copy_replayed_through_the_step_records_equals_the_source_bit_for_bit(name: str, behind: int) -> None:
    source = Trainer(OPTIMIZERS[name])
    source.train(3)
    joiner = source.copy(OPTIMIZERS[name])
    log = DeltaLog(source.optimizer, since_step=source.step, max_steps=8, step_of=lambda: source.step + 1)
    source.train(behind)

    assert [d.step for d in log.deltas] == list(range(4, 4 + behind))
    assert replay(joiner.optimizer, log.deltas, at_step=joiner.step) == source.step
    got, want = state_tensors(joiner), state_tensors(source)
    assert len(got) == len(want) > 6
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [g["lr"] for g in joiner.optimizer.param_groups] == [dict(h)["lr"] for h in log.deltas[-1].hyper]
    assert all(p.grad is None for p in joiner.model.parameters())
    log.close()


def test_without_the_records_the_copy_stays_behind() -> None:
    """The check above can fail: the copy alone is not the source's state once the source trained on."""
    source = Trainer(OPTIMIZERS["adam"])
    source.train(3)
    joiner = source.copy(OPTIMIZERS["adam"])
    source.train(1)
    assert not all(torch.equal(a, b) for a, b in zip(state_tensors(joiner), state_tensors(source), strict=True))


def test_a_record_holds_one_gradient_per_parameter_a_third_of_an_adam_ranks_state() -> None:
    source = Trainer(OPTIMIZERS["adam"])
    source.train(1)  # odd step: the branch has a gradient, so every parameter has Adam state
    log = DeltaLog(source.optimizer, since_step=1, max_steps=4, step_of=lambda: source.step + 1)
    source.train(2)
    param_bytes = sum(p.numel() * p.element_size() for p in source.model.parameters())
    branch_bytes = sum(p.numel() * p.element_size() for p in source.model.branch.parameters())
    moments = sum(
        t.numel() * t.element_size() for s in source.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])
    )
    assert moments == 2 * param_bytes
    assert [d.nbytes for d in log.deltas] == [param_bytes - branch_bytes, param_bytes]  # step 2 is even: no branch
    assert log.nbytes == 2 * param_bytes - branch_bytes
    assert log.deltas[0].grads[2] is None and log.deltas[1].grads[2] is not None


def test_the_log_records_only_after_its_step_and_gives_up_past_its_bound() -> None:
    source = Trainer(OPTIMIZERS["sgd-nesterov-wd"])
    log = DeltaLog(source.optimizer, since_step=2, max_steps=2, step_of=lambda: source.step + 1)
    source.train(4)
    assert [d.step for d in log.deltas] == [3, 4] and not log.overflowed
    source.train(1)
    assert log.overflowed and log.deltas == () and log.nbytes == 0
    source.train(1)
    assert log.deltas == ()
    log.close()
    assert not source.optimizer._optimizer_step_pre_hooks  # closed: the hook is gone


def records(source: Trainer, steps: int) -> tuple[StepDelta, ...]:
    log = DeltaLog(source.optimizer, since_step=source.step, max_steps=steps, step_of=lambda: source.step + 1)
    source.train(steps)
    deltas = log.deltas
    log.close()
    return deltas


def test_replay_refuses_a_missing_step() -> None:
    source = Trainer(OPTIMIZERS["adam"])
    joiner = source.copy(OPTIMIZERS["adam"])
    deltas = records(source, 3)
    with pytest.raises(CatchUpError, match="jump from step 0 to 2: step 1 is missing"):
        replay(joiner.optimizer, deltas[1:], at_step=0)


def test_replay_refuses_a_gradient_of_another_shape() -> None:
    source = Trainer(OPTIMIZERS["adam"])
    joiner = source.copy(OPTIMIZERS["adam"])
    (delta,) = records(source, 1)
    bad = StepDelta(step=1, grads=(torch.zeros(2), *delta.grads[1:]), hyper=delta.hyper)
    with pytest.raises(
        CatchUpError, match=r"gradient of parameter 0 is \(2,\) torch.float32; the parameter is \(5, 6\)"
    ):
        replay(joiner.optimizer, [bad], at_step=0)
    with pytest.raises(CatchUpError, match="holds 5 gradients in 2 groups; this optimizer has 6 parameters"):
        replay(joiner.optimizer, [StepDelta(step=1, grads=delta.grads[1:], hyper=delta.hyper)], at_step=0)


@pytest.mark.parametrize(
    ("copy_s", "step_s", "max_records", "kind", "enter_at", "replayed", "paused", "budget"),
    [
        (2.5, 1.0, 8, EntryKind.REPLAY, 14, 4, 100, 0.0),  # 3 steps of copy, 1 of margin; one record may be in flight
        (0.01, 1.0, 8, EntryKind.REPLAY, 12, 2, 100, 0.0),  # a copy shorter than a step still enters a step later
        (8.0, 1.0, 8, EntryKind.FULL, 11, 0, 3000, 0.0),  # 9 records past a bound of 8: the state, survivors waiting
        (0.0, 0.5, 1, EntryKind.FULL, 11, 0, 3000, 0.0),  # nothing to hide: a copy that costs no time
        (0.2, 1.0, 8, EntryKind.FULL, 11, 0, 3000, 0.25),  # a full copy within the pause budget
        (0.3, 1.0, 8, EntryKind.REPLAY, 12, 2, 100, 0.25),
    ],
)
def test_plan_entry(copy_s, step_s, max_records, kind, enter_at, replayed, paused, budget) -> None:
    plan = plan_entry(
        copy_step=10,
        copy_s=copy_s,
        step_s=step_s,
        state_bytes=3000,
        record_bytes=100,
        max_records=max_records,
        pause_budget_s=budget,
    )
    assert (plan.kind, plan.enter_at, plan.records, plan.paused_bytes) == (kind, enter_at, replayed, paused)


@pytest.mark.parametrize(
    "bad",
    [
        {"step_s": 0.0},
        {"copy_s": -1.0},
        {"max_records": 0},
        {"margin_steps": 0},
        {"copy_step": -1},
        {"pause_budget_s": -1},
    ],
)
def test_plan_entry_refuses_bad_input(bad: dict) -> None:
    args = {"copy_step": 0, "copy_s": 1.0, "step_s": 1.0, "state_bytes": 1, "record_bytes": 1, "max_records": 4}
    with pytest.raises(ValueError, match="plan_entry needs"):
        plan_entry(**{**args, **bad})


@pytest.mark.parametrize("bad", [{"max_steps": 0}, {"since_step": -1}])
def test_delta_log_refuses_bad_bounds(bad: dict) -> None:
    trainer = Trainer(OPTIMIZERS["adam"])
    with pytest.raises(ValueError, match="must be"):
        DeltaLog(trainer.optimizer, **{"since_step": 0, "max_steps": 1, **bad}, step_of=lambda: 1)
