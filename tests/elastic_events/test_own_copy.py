"""HSDP's copy one step back (elastic_events.rounds.own_copy): what it holds after the live state moves on."""

from __future__ import annotations

import torch

from elastic_events.rounds.own_copy import OwnCopy
from elastic_events.rounds.snapshot import Piece, capture


def trained_once() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return model, opt


def piece_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, small: dict) -> Piece:
    c = capture(model, opt)
    return Piece(
        owner=1,
        round=3,
        world_size=4,
        step=step,
        layout=c.layout,
        small=small,
        param_groups=c.param_groups(opt),
        tensors=c.tensors,
    )


def test_the_copy_keeps_the_state_and_small_state_of_its_step_while_the_live_ones_move_on() -> None:
    model, opt = trained_once()
    sampler = {"position": 40}
    before = [t.clone() for t in capture(model, opt).tensors]
    own = OwnCopy()
    assert own.piece() is None and own.step is None
    own.take(piece_of(model, opt, step=5, small={"step": 5, "sampler": sampler}))

    opt.step()  # the step the copy was taken before: the live weights and momentum change
    sampler["position"] = 48
    kept = own.piece()
    assert kept is not None and (kept.step, kept.owner) == (5, 1) and own.step == 5
    assert kept.small == {"step": 5, "sampler": {"position": 40}}  # a copy, not the live sampler state
    after = capture(model, opt).tensors
    for live, old, copied, entry in zip(after, before, kept.tensors, kept.layout.entries, strict=True):
        assert not torch.equal(live, old), entry.key  # each tensor of the state moved on
        assert torch.equal(copied.view(entry.dtype).view(entry.local_shape), old), entry.key
    assert own.nbytes == kept.layout.nbytes and own.taken == 1


def test_a_copy_after_the_optimizer_state_appears_grows_the_buffer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    own = OwnCopy()
    own.take(piece_of(model, opt, step=0, small={"step": 0}))  # before the first step: no momentum yet
    weights_only = own.nbytes
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    own.take(piece_of(model, opt, step=1, small={"step": 1}))
    kept = own.piece()
    assert kept is not None and kept.step == 1 and own.nbytes > weights_only
    assert [e.key[0] for e in kept.layout.entries].count("optim") == 2  # momentum of weight and bias
